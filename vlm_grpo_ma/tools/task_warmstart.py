"""The supervised cold start of any registered task (``python -m vlm_grpo_ma.warmstart --task NAME``, the
generic path of ``tools/warmstart.py``): the task's own training split, teacher-forced on ``Task.target(sample)``
through the trainer's one log-prob path, its held-out split scored with its own reward before and after, and a
plain model folder written for a run's ``model.name_or_path``. Also the pieces both warm-start paths train with:
``completion_loss`` and ``train_supervised``."""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from vlm_grpo_ma.engines.tool_server import ToolServer, tool_context
from vlm_grpo_ma.model.loading import Policy, checked_model_path, load_policy
from vlm_grpo_ma.model.logprobs import sequence_logprobs
from vlm_grpo_ma.model.lora import apply_lora, freeze_vision, trainable_parameters, vision_tower
from vlm_grpo_ma.model.prompts import EncodedPrompt, encode_prompt
from vlm_grpo_ma.model.tiny import TINY_MODEL_NAME
from vlm_grpo_ma.run.evaluation import EvalSettings
from vlm_grpo_ma.task_api.images import ImageLoadError
from vlm_grpo_ma.task_api.registry import Sample, get_task, load_samples


def completion_loss(policy: Policy, prompts: list[EncodedPrompt], texts: list[str], samples: list[Sample] | None = None) -> torch.Tensor:
    """The supervised loss: the mean negative log-prob per token of each text, then the end of the turn
    (``<|im_end|>``), after its prompt, through the trainer's one log-prob path (``sequence_logprobs``). A text
    that calls its task's tools (``samples`` given) is replayed as the sampler feeds it: each call served and its
    result's turn placed after it, as context (not imitated)."""
    eos = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    server = ToolServer.for_rollout(policy, samples, prompts, 1, max_turns=1) if samples is not None else None
    targets, turns = [], []
    for index, text in enumerate(texts):
        ids, row_turns = server.replay(index, text) if server is not None else (policy.tokenizer.encode(text, add_special_tokens=False), [])
        targets.append(ids + [eos])
        turns.append(row_turns)
    logprobs = sequence_logprobs(policy, prompts, list(range(len(prompts))), targets, temperature=1.0, thought_turns=turns)
    imitated = sum(len(t) for t in targets) - sum(len(turn.ids) for row in turns for turn in row)
    return -logprobs.sum() / imitated  # the turns' tokens hold log-prob 0


def train_supervised(parameters, steps: int, learning_rate: float, step_loss, *, label: str, report=None, report_every: int = 0):
    """AdamW with a 20-step warm-up then a linear decay to a tenth; gradients clipped at 1. ``report`` is
    called every ``report_every`` steps and printed."""
    parameters = list(parameters)
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / max(steps, 1))
    )
    started = time.perf_counter()
    for step in range(1, steps + 1):
        loss = step_loss()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps:
            print(f"{label} step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - started:.0f}s", flush=True)
        if report is not None and report_every and (step % report_every == 0 or step == steps):
            print(f"{label} step {step:5d}  held-out: {report()}", flush=True)


# Any other registered task: a supervised cold start on its own training split, taught by Task.target

WARMSTART_FILE = "warmstart.json"  # what a warm start writes next to its model: settings, before, after
GENERIC_DEFAULTS = {"decoder_steps": 200, "batch_size": 16, "decoder_learning_rate": 1e-3}
STREAM_DEFAULTS = {"decoder_steps": 4000, "batch_size": 32, "decoder_learning_rate": 2e-3}


class WarmStartError(ValueError):
    """A refusal of one line: the task, its data or the arguments cannot be warm-started."""


def require_target(task) -> None:
    """A task that cannot say what a good completion is cannot be imitated: refused, naming the function to add."""
    if task.target is None:
        raise WarmStartError(
            f"task {task.name!r} has no target, so there is nothing to imitate: add target=... to its Task, a function"
            " target(sample) -> str giving the whole completion a good model writes,"
            " '<think>...</think><answer>...</answer>' (docs/TASKS.md, 'Will my task learn?')"
        )


def task_targets(task, samples: list[Sample]) -> list[tuple[Sample, str]]:
    """(sample, ``task.target(sample)``) for every sample whose target is a non-empty string; a target that raises
    or returns anything else skips its sample, counted and said in one line with the first cause."""
    if takes_context(task.target):  # written once each prompt is encoded (TargetBatches.take)
        return [(sample, None) for sample in samples]
    pairs, skipped, first = [], 0, None
    for sample in samples:
        try:
            text = task.target(sample)
            if not isinstance(text, str) or not text.strip():
                raise TypeError(f"it returned {text!r}, not a non-empty str")
        except Exception as error:  # noqa: BLE001 - a bad row is skipped and counted, never the whole warm start
            skipped += 1
            first = first or f"sample {sample.id!r}: {type(error).__name__}: {error}"
            continue
        pairs.append((sample, text))
    if skipped:
        print(f"skipped {skipped} of {len(samples)} training samples whose target failed (first: {first})", flush=True)
    if not pairs:
        raise WarmStartError(f"task {task.name!r}: target(sample) gave no completion for any of its {len(samples)} training samples ({first})")
    return pairs


def takes_context(target) -> bool:
    """Whether ``target`` is ``target(sample, context)``: a target that writes boxes (a zoom call) gets the
    ``task_api.ToolContext`` of the encoded prompt, to write them in the model's frame."""
    import inspect

    return len(inspect.signature(target).parameters) >= 2


def context_target(task, sample: Sample, prompt: EncodedPrompt, policy: Policy) -> str:
    """``task.target(sample, context)`` for the prompt as the model sees it; ValueError when it gives no text."""
    text = task.target(sample, tool_context(policy, sample, prompt))
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"sample {sample.id!r}: target gave {text!r}, not a non-empty str")
    return text


class TargetBatches:
    """Batches of (encoded prompt, target) from a task's training pairs, in a fresh seeded order each epoch. A
    sample whose image or video cannot be read is dropped for the rest of the warm start, and counted."""

    def __init__(self, policy: Policy, task, pairs: list[tuple[Sample, str]], batch_size: int, seed: int):
        self._policy, self._task, self._pairs, self._batch_size = policy, task, list(pairs), batch_size
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.broken: set[str] = set()

    def _next_pair(self) -> tuple[Sample, str]:
        while True:
            if not self._order:
                if len(self.broken) == len(self._pairs):
                    raise WarmStartError(f"task {self._task.name!r}: no training sample's image or video could be read")
                self._order = list(range(len(self._pairs)))
                self._rng.shuffle(self._order)
            sample, text = self._pairs[self._order.pop()]
            if sample.id not in self.broken:
                return sample, text

    def take(self) -> tuple[list[EncodedPrompt], list[str], list[Sample]]:
        prompts, texts, samples = [], [], []
        while len(prompts) < self._batch_size:
            sample, text = self._next_pair()
            try:
                prompt = encode_prompt(self._policy, sample, self._task.instruction)
                text = text if text is not None else context_target(self._task, sample, prompt, self._policy)
            except (ImageLoadError, ValueError) as error:  # VideoLoadError is one; a target that fails on the sample
                self.broken.add(sample.id)
                print(f"skipping training sample {sample.id!r} from now on: {error}", flush=True)
                continue
            prompts.append(prompt)
            texts.append(text)
            samples.append(sample)
        return prompts, texts, samples


def held_out_metrics(policy: Policy, task, samples: list[Sample], settings: EvalSettings, description: str) -> dict[str, float]:
    """Greedy metrics of ``samples`` with the task's own reward, by the code the trainer's held-out evaluation
    runs (``run/evaluation.py``), in eval mode (the training mode is put back)."""
    from vlm_grpo_ma.run.evaluation import evaluate_task

    was_training = policy.model.training
    policy.model.eval()
    with torch.no_grad():
        metrics, _ = evaluate_task(policy, task, samples, settings, description=description)
    policy.model.train(was_training)
    return metrics


def metrics_line(task, metrics: dict[str, float]) -> str:
    """The reward, the task's logged parts and its accuracy, as ``name value`` pairs; for a task a served judge
    scores (which the warm start does not ask), a note that its judged parts read 0."""
    names = dict.fromkeys(("reward", *task.metrics, "accuracy"))
    line = " ".join(f"{name} {metrics[name]:.3f}" for name in names if name in metrics)
    return line + (" (no judge asked: judged parts read 0)" if task.judge_query is not None else "")


def checked_output_folder(out: Path) -> Path:
    """``out`` may be new, empty, or an earlier warm start's folder (it holds ``warmstart.json``), which is
    replaced; anything else (a run's folder, a committed model) is refused."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / WARMSTART_FILE).is_file())):
        raise WarmStartError(f"--out {out} exists and is not a warm start's folder (no {WARMSTART_FILE}); choose a new folder")
    return out


def warm_start_task(
    task_name: str,
    out: Path,
    *,
    model: str = "tiny",
    steps: int = GENERIC_DEFAULTS["decoder_steps"],
    batch_size: int = GENERIC_DEFAULTS["batch_size"],
    learning_rate: float = GENERIC_DEFAULTS["decoder_learning_rate"],
    lora_rank: int = 0,
    train_vision: bool = False,
    eval_split: str = "test",
    eval_samples: int = 100,
    settings: EvalSettings | None = None,
    eval_every: int = 0,
    seed: int = 0,
    dtype: str = "float32",
) -> dict:
    """Supervised cold start of ``model`` on task ``task_name``'s training split (``Task.load("train")``),
    teacher-forced on ``Task.target(sample)`` after each prompt; the decoder trains (LoRA adapters of
    ``lora_rank``, merged into the weights at the end, when > 0), the vision tower too with ``train_vision``.
    The first ``eval_samples`` of ``eval_split`` are scored greedily with the task's reward before and after.
    Writes a plain model folder (weights, processor) to ``out`` with ``warmstart.json``; returns that record.
    WarmStartError (a ValueError) of one line for a task without target, data that does not load, or an
    ``out`` that is not a warm start's folder, before the model loads."""
    from vlm_grpo_ma.run.config import ModelConfig

    started = time.perf_counter()
    task = get_task(task_name)
    require_target(task)
    checked_output_folder(out)
    for value, name in ((steps, "--steps"), (batch_size, "--batch-size"), (eval_samples, "--eval-samples")):
        if value < 1:
            raise WarmStartError(f"{name} must be >= 1, got {value}")
    if lora_rank < 0:
        raise WarmStartError(f"--lora-rank must be >= 0 (0: train the weights themselves), got {lora_rank}")
    if not 0 < learning_rate < float("inf"):
        raise WarmStartError(f"--learning-rate must be a number > 0, got {learning_rate}")
    checked_model_path(model, "--model")  # a mistyped folder or hub id: one line, before the data loads
    splits = {}
    for split in ("train", eval_split):
        try:
            splits[split] = load_samples(task, split)
        except (FileNotFoundError, ValueError) as error:
            hint = " (--eval-split names another held-out split)" if split == eval_split else ""
            raise WarmStartError(f"task {task.name!r}: its {split!r} split does not load{hint}: {error}") from error
        if not splits[split]:
            raise WarmStartError(f"task {task.name!r}: its {split!r} split has no samples")
    pairs = task_targets(task, splits["train"])
    held_out = splits[eval_split][:eval_samples]
    settings = settings or EvalSettings()

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_policy(model, dtype=dtype, device=device, attn_implementation="sdpa")
    print(f"warm start of task {task.name!r} from {model}: {len(pairs)} training samples, {len(held_out)} held-out"
          f" ({eval_split}), {steps} steps of {batch_size}", flush=True)  # fmt: skip
    before = held_out_metrics(policy, task, held_out, settings, "held-out before")
    print(f"held-out before ({len(held_out)} {eval_split} samples): {metrics_line(task, before)}", flush=True)

    if lora_rank:
        defaults = ModelConfig()
        policy.adapter = apply_lora(
            policy.model, rank=lora_rank, alpha=defaults.lora_alpha, dropout=defaults.lora_dropout,
            target_modules=defaults.lora_target_modules, base_model_name_or_path=model,
        )  # fmt: skip
    if train_vision:
        vision_tower(policy.model).requires_grad_(True)
    else:
        freeze_vision(policy.model)
    policy.model.train()
    batches = TargetBatches(policy, task, pairs, batch_size, seed)
    train_supervised(
        trainable_parameters(policy.model), steps, learning_rate, lambda: completion_loss(policy, *batches.take()),
        label="warm start",
        report=(lambda: metrics_line(task, held_out_metrics(policy, task, held_out, settings, "held-out"))) if eval_every else None,
        report_every=eval_every,
    )  # fmt: skip
    if policy.adapter is not None:  # a plain model folder, which a run's model.name_or_path takes
        policy.model = policy.adapter.merge_and_unload(safe_merge=True)
        policy.adapter = None
    after = held_out_metrics(policy, task, held_out, settings, "held-out after")
    print(f"held-out after  ({len(held_out)} {eval_split} samples): {metrics_line(task, after)}", flush=True)

    record = {
        "task": task.name, "model": model, "steps": steps, "batch_size": batch_size, "learning_rate": learning_rate,
        "lora_rank": lora_rank, "train_vision": train_vision, "seed": seed, "train_samples": len(pairs),
        "skipped_samples": len(splits["train"]) - len(pairs) + len(batches.broken),
        "eval_split": eval_split, "eval_samples": len(held_out), "before": before, "after": after,
        "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    # written beside, then swapped in: an interrupted warm start never leaves a half-written model at ``out``
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    policy.model.save_pretrained(partial)
    policy.processor.save_pretrained(partial)
    (partial / WARMSTART_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(f"wrote the warm-started model to {out} ({record['seconds']:.0f} s); train from it with"
          f" model.name_or_path={out}", flush=True)  # fmt: skip
    return record


def refuse(message: str) -> None:
    """One line on stderr and exit status 2, as argparse's own refusals."""
    print(f"python -m vlm_grpo_ma.warmstart: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def warm_start_from_args(args, settings: EvalSettings) -> None:
    """``warm_start_task`` with the command line's choices (``tools/warmstart.py``'s parser), each unset one at
    ``GENERIC_DEFAULTS``; a refusal is one line and exit status 2."""
    chosen = {name: default if getattr(args, name) is None else getattr(args, name) for name, default in GENERIC_DEFAULTS.items()}
    try:
        warm_start_task(
            args.task, args.out or Path("runs") / f"{args.task}-warm", model=args.init or TINY_MODEL_NAME,
            steps=chosen["decoder_steps"], batch_size=chosen["batch_size"], learning_rate=chosen["decoder_learning_rate"],
            lora_rank=args.lora_rank, train_vision=args.train_vision,
            eval_split=args.eval_split or "test", eval_samples=args.eval_scenes, settings=settings,
            eval_every=args.eval_every or 0, seed=args.seed, dtype=args.dtype or "float32",
        )  # fmt: skip
    except (WarmStartError, FileNotFoundError) as error:  # FileNotFoundError: a model folder or hub id not found
        refuse(str(error))
