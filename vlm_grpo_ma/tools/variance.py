"""The thought advantage's variance against M, measured by resampling: ``python -m vlm_grpo_ma.variance RUN``.

GRPO-MA's claim (arXiv 2509.24494) is that a thought's value, the mean reward of its M answers, and so the thought
advantage normalised from those values over the K thoughts of a prompt, get less noisy as M grows, like 1/M. The
per-step ``grpo_ma/thought_value_noise_var`` (s2 / M from each step's own answers) assumes that law; this command
measures it. For fixed thoughts (K per prompt, sampled once from a run's checkpoint on held-out prompts) it samples
``resamples * max(M)`` answers from each thought's KV cache, scores them with the task's reward as training does,
and for every M splits them into ``resamples`` disjoint groups of M: R independent redraws of the M answers of
every thought. Across the R redraws it takes, per thought,

- the variance of the thought's value (the mean reward of its M answers), and
- the variance of its thought advantage (``advantages.grpo_ma_advantages`` with the run's numerics, over the K
  thoughts of its prompt, every thought's answers redrawn together),

and averages them over the thoughts, with a 95% bootstrap interval over thoughts. Next to them, the predictions:

- value: s2_k / M, with s2_k the variance of all ``resamples * max(M)`` rewards of thought k (exact for a mean of
  M independent draws);
- advantage, the delta method: the normalisation linearised at the thoughts' values ``mu`` (the means of all their
  answers), each value carrying variance s2_j / M: ``sum_j (d A_k / d v_j)^2 s2_j / M``. It holds where the
  linearisation does, that is for M large enough that a value's noise is small against the spread of the K values;
  at small M the measured variance falls below it (a normalised advantage is bounded, its linearisation is not).

Writes ``variance.json`` (every figure, per M) and ``variance.png`` (both variances against M, log-log, with the
1/M line through M = 1 and the predictions) into ``--out``, and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_grpo_ma.algorithm.advantages import grpo_ma_advantages
from vlm_grpo_ma.task_api.registry import load_samples

DEFAULT_ANSWERS = (1, 2, 4, 8, 16)
DEFAULT_RESAMPLES = 32
BOOTSTRAP_DRAWS = 2000


# ----------------------------------------------------------------------------------------------------------
# The math (pure: rewards in, variances out)


def resample_groups(rewards: torch.Tensor, num_answers: int, resamples: int) -> torch.Tensor:
    """``rewards[B, K, N]`` (N answers per thought) -> ``[R, B, K, M]``: redraw r holds answers r*M .. r*M + M - 1
    of every thought, so the R redraws are disjoint, hence independent."""
    batch, thoughts, available = rewards.shape
    if num_answers * resamples > available:
        raise ValueError(f"{resamples} redraws of M={num_answers} answers need {num_answers * resamples} answers per thought; there are {available}")
    used = rewards[..., : num_answers * resamples].reshape(batch, thoughts, resamples, num_answers)
    return used.permute(2, 0, 1, 3)


def thought_values_and_advantages(groups: torch.Tensor, **numerics) -> tuple[torch.Tensor, torch.Tensor]:
    """Per redraw, every thought's value (mean of its M rewards) and thought advantage: ``groups[R, B, K, M]`` ->
    two ``[R, B, K]`` tensors. The advantage is the trainer's (``grpo_ma_advantages``), prompt by prompt."""
    redraws, batch, thoughts, answers = groups.shape
    flat = groups.reshape(redraws * batch, thoughts, answers)
    thought_adv, _ = grpo_ma_advantages(flat, **numerics)
    return flat.mean(dim=-1).reshape(redraws, batch, thoughts), thought_adv.reshape(redraws, batch, thoughts)


def across_redraws_variance(values: torch.Tensor) -> torch.Tensor:
    """``values[R, B, K]`` -> ``[B, K]``: each thought's variance across the R redraws (divided by R - 1)."""
    return values.var(dim=0, unbiased=True)


def predicted_value_variance(rewards: torch.Tensor, num_answers: int) -> torch.Tensor:
    """``[B, K]``: s2_k / M, s2_k the (population) variance of all of thought k's rewards."""
    return rewards.var(dim=-1, unbiased=False) / num_answers


def delta_method_advantage_variance(rewards: torch.Tensor, num_answers: int, **numerics) -> torch.Tensor:
    """``[B, K]``: the thought advantage's variance to first order, ``sum_j J_kj^2 s2_j / M`` with J the
    Jacobian of the normalisation over the K thoughts at their values mu (means of all their rewards)."""
    mu = rewards.mean(dim=-1)  # [B, K]
    s2 = rewards.var(dim=-1, unbiased=False)  # [B, K]
    out = torch.zeros_like(mu)
    for b in range(mu.shape[0]):
        def normalise(values: torch.Tensor) -> torch.Tensor:
            return grpo_ma_advantages(values[None, :, None], **numerics)[0][0]

        jacobian = torch.autograd.functional.jacobian(normalise, mu[b].double())  # [K, K]
        out[b] = (jacobian.pow(2) @ s2[b].double() / num_answers).to(out.dtype)
    return out


def bootstrap_mean_interval(per_thought: torch.Tensor, *, draws: int = BOOTSTRAP_DRAWS, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile interval of the mean of ``per_thought`` (any shape; its elements are the units),
    resampling the units with replacement."""
    units = per_thought.reshape(-1).double()
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(units), (draws, len(units)), generator=generator)
    means = units[picks].mean(dim=1)
    return float(torch.quantile(means, 0.025)), float(torch.quantile(means, 0.975))


def right_thought_signal(rewards: torch.Tensor, right: torch.Tensor, **numerics) -> dict[str, float]:
    """Whether the thought advantage tells right thoughts from wrong ones: ``right[B, K]`` (1: the thought names
    the target) -> the number of each, their mean value (mean of all their rewards) and their mean advantage at
    those values (the advantage an infinite M would give), over the prompts that hold both kinds."""
    values = rewards.mean(dim=-1)
    advantages, _ = grpo_ma_advantages(values[..., None], **numerics)
    mixed = (right.sum(dim=-1) > 0) & (right.sum(dim=-1) < right.shape[-1])  # prompts with right and wrong thoughts
    is_right, is_wrong = (right > 0) & mixed[:, None], (right == 0) & mixed[:, None]
    mean = lambda x, where: float(x[where].mean()) if where.any() else float("nan")  # noqa: E731
    return {
        "prompts_with_both": int(mixed.sum()),
        "right_thoughts": int((right > 0).sum()),
        "wrong_thoughts": int((right == 0).sum()),
        "value_right": mean(values, is_right),
        "value_wrong": mean(values, is_wrong),
        "advantage_right": mean(advantages, is_right),
        "advantage_wrong": mean(advantages, is_wrong),
    }


@dataclass
class VarianceAtM:
    num_answers: int
    value_var: float  # measured, mean over thoughts
    value_interval: tuple[float, float]
    value_predicted: float  # s2 / M
    advantage_var: float
    advantage_interval: tuple[float, float]
    advantage_predicted: float  # delta method


def measure(rewards: torch.Tensor, answer_counts: tuple[int, ...], resamples: int, **numerics) -> list[VarianceAtM]:
    """Every figure of the table from ``rewards[B, K, N]`` with N >= resamples * max(answer_counts)."""
    rewards = rewards.double()
    out = []
    for m in answer_counts:
        values, advantages = thought_values_and_advantages(resample_groups(rewards, m, resamples), **numerics)
        value_var, advantage_var = across_redraws_variance(values), across_redraws_variance(advantages)
        out.append(
            VarianceAtM(
                num_answers=m,
                value_var=float(value_var.mean()),
                value_interval=bootstrap_mean_interval(value_var),
                value_predicted=float(predicted_value_variance(rewards, m).mean()),
                advantage_var=float(advantage_var.mean()),
                advantage_interval=bootstrap_mean_interval(advantage_var),
                advantage_predicted=float(delta_method_advantage_variance(rewards, m, **numerics).mean()),
            )
        )
    return out


# ----------------------------------------------------------------------------------------------------------
# Sampling the answers of fixed thoughts


def sample_rewards(run_dir: Path, *, step: int | None, prompts: int, thoughts: int, answers_per_thought: int, seed: int,
                   progress: bool = True) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """``rewards[B, K, N]`` of ``prompts`` held-out prompts of the run's (first) task, K thoughts each sampled once
    from the checkpoint, N answers per thought from the thought's KV cache, scored as training scores them (the
    run's config: sampling settings, reward weights, rule for truncated thoughts); and a description."""
    from tqdm.auto import tqdm

    from vlm_grpo_ma.engines.decode import prompt_generators
    from vlm_grpo_ma.engines.rollout import generate_rollout
    from vlm_grpo_ma.model.prompts import encode_prompt
    from vlm_grpo_ma.run.config_files import load_config
    from vlm_grpo_ma.run.loop import sampling_settings
    from vlm_grpo_ma.run.rewards import score_rollout
    from vlm_grpo_ma.run.setup import load_model_policy
    from vlm_grpo_ma.task_api.registry import get_task, import_task_modules
    from vlm_grpo_ma.tools.evaluate import resolve_model

    cfg = load_config(run_dir / "config.yaml")
    import_task_modules(cfg.data.task_modules)
    model = resolve_model(str(run_dir), step)
    policy = load_model_policy(cfg, model.path, "cpu")
    policy.model.eval()
    task_name = cfg.data.task if not cfg.data.tasks else sorted(cfg.data.tasks)[0]
    task = get_task(task_name)
    samples = load_samples(task, cfg.data.eval_split, cfg.data.eval_sources.get(task_name))[:prompts]
    rows, rights, distinct = [], [], []
    for index, sample in enumerate(tqdm(samples, desc="prompts", disable=not progress)):
        settings = dataclasses.replace(sampling_settings(cfg, 0, 0, 1), generators=prompt_generators(seed, index, 1))
        rollout = generate_rollout(policy, [sample], [encode_prompt(policy, sample, task.instruction)],
                                   num_thoughts=thoughts, num_answers=answers_per_thought, settings=settings)  # fmt: skip
        scored = score_rollout(rollout, weight_overrides=cfg.data.reward_weights, truncated_thoughts=cfg.rollout.truncated_thoughts,
                               workers=cfg.rollout.reward_workers, timeout_s=cfg.rollout.reward_timeout_s)  # fmt: skip
        rows.append(scored.rewards[0])
        right = scored.parts.get("right_thought")  # the same for every answer of a thought (tasks that can tell)
        rights.append(right[0, :, 0] if right is not None else torch.full((thoughts,), float("nan")))
        distinct.append(len({tuple(ids) for ids in rollout.tree.thought_ids}))  # K thoughts of one text: equal true values
    numerics = dict(scale_by_std=cfg.algorithm.scale_by_std, eps=cfg.algorithm.eps, unbiased=cfg.algorithm.std_unbiased)
    about = {"run": str(run_dir), "checkpoint": model.label, "task": task_name, "split": cfg.data.eval_split,
             "prompts": len(samples), "thoughts": thoughts, "answers_per_thought": answers_per_thought, "seed": seed,
             "temperature": cfg.rollout.temperature, "numerics": numerics, "distinct_thoughts": distinct}  # fmt: skip
    right = torch.stack(rights)
    if not right.isnan().any():
        about["right_thoughts"] = right_thought_signal(torch.stack(rows).double(), right, **numerics)
    return torch.stack(rows), about


# ----------------------------------------------------------------------------------------------------------
# Output


def table(results: list[VarianceAtM]) -> str:
    lines = [
        "| M | thought value: measured variance (95% interval) | s2 / M | x M | thought advantage: measured variance (95% interval) | delta method | x M |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.num_answers} | {r.value_var:.5f} ({r.value_interval[0]:.5f}-{r.value_interval[1]:.5f}) | {r.value_predicted:.5f} | "
            f"{r.value_var * r.num_answers:.4f} | {r.advantage_var:.4f} ({r.advantage_interval[0]:.4f}-{r.advantage_interval[1]:.4f}) | "
            f"{r.advantage_predicted:.4f} | {r.advantage_var * r.num_answers:.3f} |"
        )
    return "\n".join(lines)


def plot(results: list[VarianceAtM], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [r.num_answers for r in results]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        ("thought value (mean reward of M answers)", "value_var", "value_interval", "value_predicted", "s2 / M"),
        ("thought advantage (normalised over K thoughts)", "advantage_var", "advantage_interval", "advantage_predicted", "delta method"),
    )
    for axis, (title, key, interval, predicted, label) in zip(axes, panels, strict=True):
        measured = [getattr(r, key) for r in results]
        low = [m - getattr(r, interval)[0] for m, r in zip(measured, results, strict=True)]
        high = [getattr(r, interval)[1] - m for m, r in zip(measured, results, strict=True)]
        anchor_m, anchor = ms[0], measured[0]
        axis.plot(ms, [anchor * anchor_m / m for m in ms], "--", color="grey", label=f"1/M through M = {anchor_m}")
        axis.plot(ms, [getattr(r, predicted) for r in results], ":", color="tab:orange", label=label)
        axis.errorbar(ms, measured, yerr=[low, high], fmt="o", capsize=3, color="tab:blue", label="measured (95% interval)")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("M (answers per thought)")
        axis.set_ylabel("variance across redraws")
        axis.set_title(title)
        axis.grid(alpha=0.3, which="both")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def write_outputs(results: list[VarianceAtM], about: dict, out: Path, resamples: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {**about, "resamples": resamples, "results": [vars(r) for r in results]}
    (out / "variance.json").write_text(json.dumps(payload, indent=2))
    plot(results, out / "variance.png")


def read_outputs(out: Path) -> tuple[list[VarianceAtM], dict] | None:
    """What ``write_outputs`` wrote in ``out``, or None when it is not there."""
    path = out / "variance.json"
    if not path.is_file():
        return None
    payload = json.loads(path.read_text())
    results = [_result(r) for r in payload.pop("results")]
    return results, payload


def differing_results(about: dict) -> list[VarianceAtM]:
    """The table over the prompts whose K thoughts are not all the same text (``about["differing"]``)."""
    return [_result(r) for r in about["differing"]["results"]]


def _result(record: dict) -> VarianceAtM:
    return VarianceAtM(**{**record, "value_interval": tuple(record["value_interval"]), "advantage_interval": tuple(record["advantage_interval"])})


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo_ma.variance",
        description="Measure the variance of GRPO-MA's thought values and thought advantages against M by redrawing "
        "the answers of fixed thoughts from a run's checkpoint.",
    )
    parser.add_argument("run", help="a run directory (its latest checkpoint, or --step)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (default 16)")
    parser.add_argument("--thoughts", type=int, default=4, help="K, thoughts per prompt (default 4)")
    parser.add_argument("--answers", type=int, nargs="+", default=list(DEFAULT_ANSWERS), help="values of M (default 1 2 4 8 16)")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help=f"R, redraws per M (default {DEFAULT_RESAMPLES})")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", help="where variance.json and variance.png go (default: RUN/variance)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    problems = [f"--{name}={value} must be >= {low}" for name, value, low in
                (("prompts", args.prompts, 1), ("thoughts", args.thoughts, 2), ("resamples", args.resamples, 2))
                if value < low]  # fmt: skip
    problems += [f"--answers {m}: M must be >= 1" for m in args.answers if m < 1]
    run_dir = Path(args.run)
    if not (run_dir / "config.yaml").is_file():
        problems.append(f"{run_dir} is not a run directory (no config.yaml)")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    answer_counts = tuple(sorted(set(args.answers)))
    started = time.perf_counter()
    try:
        rewards, about = sample_rewards(run_dir, step=args.step, prompts=args.prompts, thoughts=args.thoughts,
                                        answers_per_thought=args.resamples * answer_counts[-1], seed=args.seed)  # fmt: skip
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results = measure(rewards, answer_counts, args.resamples, **about["numerics"])
    differing = torch.tensor(about["distinct_thoughts"]) > 1  # prompts whose thoughts are not all one text
    if 0 < int(differing.sum()) < len(differing):
        subset = measure(rewards[differing], answer_counts, args.resamples, **about["numerics"])
        about["differing"] = {"prompts": int(differing.sum()), "results": [vars(r) for r in subset]}
    about["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out) if args.out else run_dir / "variance"
    write_outputs(results, about, out, args.resamples)
    print(table(results))
    if "differing" in about:
        print(f"the {about['differing']['prompts']} prompts whose {args.thoughts} thoughts are not all one text:")
        print(table(differing_results(about)))
    if "right_thoughts" in about:
        print("right vs wrong thoughts:", json.dumps(about["right_thoughts"]))
    print(f"{about['prompts']} prompts x {args.thoughts} thoughts, {args.resamples} redraws per M; "
          f"{about['seconds']:.0f} s; wrote {out / 'variance.json'} and {out / 'variance.png'}")  # fmt: skip
    return 0
