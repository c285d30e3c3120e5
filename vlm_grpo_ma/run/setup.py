"""Everything a run builds before its first step, in order: processes, run directory, data, model, optimizer,
KL reference, resumed state, logger. ``setup_run`` returns it as a ``RunState``; ``loop.train`` runs the loop.

The order is part of the behaviour: the seed is set before the data and the model (LoRA's initial adapters
draw from it), and a resumed run's RNG state is restored after everything that draws at start.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_grpo_ma.algorithm.diagnostics import GradSpikeMonitor
from vlm_grpo_ma.model import lora
from vlm_grpo_ma.model.architectures import architecture_of
from vlm_grpo_ma.model.loading import Policy, count_parameters, load_policy
from vlm_grpo_ma.model.logprobs import CompletionScorer
from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run import sharding, survive
from vlm_grpo_ma.run.batch import TrainBatch
from vlm_grpo_ma.run.config import Config, ConfigError, check_video_max_pixels
from vlm_grpo_ma.run.config_files import save_config
from vlm_grpo_ma.run.distributed import main_process_value, make_accelerator, quiet_other_processes
from vlm_grpo_ma.run.held_out import load_eval_sets
from vlm_grpo_ma.run.judge_setup import judge_for
from vlm_grpo_ma.run.memory_model import tree_too_large
from vlm_grpo_ma.run.metrics import RunLogger, drop_records_after
from vlm_grpo_ma.run.rewards import check_reward_overrides
from vlm_grpo_ma.run.rollout_engine import check_engine, make_engine, media_room
from vlm_grpo_ma.run.run_dir import (
    CONFIG_FILE,
    LOCK_FILE,
    check_resumable,
    check_shared_folder,
    checkpoint_to_resume,
    claim_run_dir,
    folder_refused,
    hold_run_dir,
    resume_history,
)
from vlm_grpo_ma.run.split_launch import RemoteEngine, in_flight_at_resume
from vlm_grpo_ma.run.trackers import check_trackers, open_trackers, run_params
from vlm_grpo_ma.run.update import score_rows
from vlm_grpo_ma.task_api.registry import (
    Sample,
    Task,
    count_load_skips,
    get_task,
    import_task_modules,
    load_samples,
)
from vlm_grpo_ma.task_api.streams import PromptStream, TaskMixture
from vlm_grpo_ma.task_api.videos import VideoBudget

log = logging.getLogger("vlm_grpo_ma.train")


@dataclass
class RunState:
    """What ``setup_run`` built: the objects the loop uses, and where a resumed run starts. No behaviour of its
    own beyond ``completed_state``."""

    cfg: Config
    accelerator: object
    run_dir: Path
    tasks: dict[str, Task]
    stream: PromptStream | TaskMixture
    eval_sets: dict[str, tuple[Task, list[Sample]]]
    policy: Policy
    scorer: torch.nn.Module  # CompletionScorer(policy), DDP-wrapped by accelerate or sharded (FSDP2)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: object  # reference(micro, prompts, accelerator, temperature) -> log-probs, or None without KL
    fsdp: object  # sharding.launch_settings() under an FSDP2 launch, else None
    logger: RunLogger
    counters: Counter
    spikes: GradSpikeMonitor
    start_step: int
    prompts_per_process: int
    engine: object  # samples the rollouts (vlm_grpo_ma/engines: rollout.engine); holds the policy's weights
    run_lock: object  # the main process's lock on the run folder (run_dir.hold_run_dir); None on the others
    judge: object = None  # the served judge of tasks that ask one (judge_setup.judge_for), else None

    def completed_state(self) -> dict:
        """The part of a checkpoint that records the steps done: data position, counters, spike history."""
        return {"data": self.stream.state_dict(), "counters": dict(self.counters), "spikes": self.spikes.state_dict()}


def setup_run(cfg: Config, *, resume: bool, overwrite: bool, split=None) -> RunState:
    from accelerate.utils import set_seed

    check_trackers(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    accelerator = make_accelerator(cfg)
    quiet_other_processes(accelerator.process_index)  # INFO and WARNING from the main process only
    if accelerator.is_main_process and accelerator.device.type == "cpu" and hasattr(os, "getloadavg"):
        busy = busy_machine_warning(os.getloadavg()[0], os.cpu_count() or 1, torch.get_num_threads(), processes_on_this_machine())
        if busy is not None:
            log.warning("%s", busy)
    num_processes = accelerator.num_processes
    check_engine(cfg, num_processes)  # vllm missing, not importing, or a TP size off the launch: stop before anything loads
    if cfg.model.lora_rank > 0:  # LoRA targets the model's decoder does not have: stop before anything loads
        try:
            lora.check_target_modules(cfg.model.name_or_path, cfg.model.lora_target_modules)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    check_tree_fits(cfg, accelerator)  # a K x M the memory model says cannot fit: stop before anything loads
    set_seed(cfg.train.seed)
    run_dir = Path(cfg.train.output_dir)
    # A refusal stops every process at this point together, and the main process says it (cli.say_error): one line
    with survive.together(accelerator):
        try:
            if run_dir.exists() and not run_dir.is_dir():
                raise ConfigError(f"train.output_dir={run_dir} is a file, not a folder; choose another --output-dir")
            under_a_file = next((folder for folder in run_dir.parents if folder.exists() and not folder.is_dir()), None)
            if under_a_file is not None:  # mkdir would raise NotADirectoryError
                raise ConfigError(f"train.output_dir={run_dir} is under {under_a_file}, a file, not a folder; choose another --output-dir")
            if resume:
                check_resumable(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # not writable, a name too long (even to look at), under /proc ...
            raise folder_refused(run_dir, "create or read it", error) from None
        run_lock = hold_run_dir(run_dir) if accelerator.is_main_process else None  # the main process holds the folder
    try:
        return _build_run(cfg, accelerator, run_dir, run_lock, resume=resume, overwrite=overwrite, split=split)
    except BaseException:
        if run_lock is not None:  # released now, not when the traceback that holds it goes
            run_lock.close()
        raise


def processes_on_this_machine() -> int:
    """The processes of this run on this machine (``LOCAL_WORLD_SIZE``, which the launchers set; 1 unlaunched)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def device_memory_bytes(device: torch.device) -> int:
    """The memory one process of a run has: its GPU's, or on a CPU the host's shared by the processes of this
    machine (``processes_on_this_machine``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // processes_on_this_machine()


# Torch's intra-op threads wait on each other at every operation, so one descheduled thread stalls the rest: on 2
# cores beside another run a step of the default run went from ~1.3 s to 35-54 s at 2 threads (10-25x, where a
# fair share is 2-3x), while runs at one thread each kept to their share (docs/TUNING.md, "Threads").
def busy_machine_warning(load_1min: float, cores: int, threads: int, processes: int = 1) -> str | None:
    """What a CPU run says at start when its torch threads (``threads`` in each of ``processes`` processes on this
    machine) would share cores with work already running: the 1-minute load average plus the run's threads come to
    at least one more than the ``cores``. None when they fit, and at one thread a process (which takes only its
    share however busy the machine is)."""
    if threads <= 1 or load_1min + threads * processes < cores + 1:
        return None
    return (
        f"this machine is busy (1-minute load average {load_1min:.1f} on {cores} cores) and the run adds"
        f" {threads * processes} torch threads ({threads} a process): a thread descheduled stalls the others at every"
        " operation, and steps can take 10-25x their time; set train.num_threads=1 (docs/TUNING.md, \"Threads\")"
    )


def check_tree_fits(cfg: Config, accelerator, videos_per_prompt: int = 0, tool_images_per_thought: int = 0) -> None:
    """ConfigError when the memory model (``memory_model.tree_too_large``) predicts that the run's K x M trees
    cannot fit in a process's memory. The HF engine's KV cache is what it counts: a vLLM engine sizes its own
    cache, and a model the memory model does not know is not checked. Called before anything loads (no
    videos counted), and again once the data is known if its prompts hold videos (``videos_per_prompt``, the
    most any prompt holds, each at the run's video budget). A split launch (``rollout.engine_processes``; the
    trainers call this, ``accelerator`` counting them alone) checks its trainers (role "trainer", no KV cache: a
    vLLM engine's run too) and its engine processes (role "engine", the HF engine's KV cache of their share),
    each against a process's memory here."""
    engines = cfg.rollout.engine_processes
    checks = [("trainer", accelerator.num_processes), ("engine", engines)] if engines else [("both", accelerator.num_processes)]
    checks = [(role, n) for role, n in checks if role == "trainer" or cfg.rollout.engine == "hf"]
    if not checks:
        return
    try:
        arch = architecture_of(cfg.model.name_or_path)
    except (ValueError, OSError, KeyError) as error:  # not a family the memory model counts
        log.debug("memory check skipped: %s", error)
        return
    strategy = "fsdp" if accelerator.num_processes > 1 and sharding.launch_settings() is not None else "ddp"
    for role, processes in checks:
        problem = tree_too_large(
            arch, cfg, processes, strategy, device_memory_bytes(accelerator.device), videos_per_prompt=videos_per_prompt,
            tool_images_per_thought=tool_images_per_thought, role=role,
        )  # fmt: skip
        if problem is not None:
            raise ConfigError(problem)


def _build_run(cfg: Config, accelerator, run_dir: Path, run_lock, *, resume: bool, overwrite: bool, split=None) -> RunState:
    """The rest of ``setup_run``, in the folder this process holds."""
    num_processes, is_main = accelerator.num_processes, accelerator.is_main_process
    if num_processes > 1:  # one folder, shared by every process: the main process decides what is in it
        stamp = main_process_value(accelerator, (run_dir / LOCK_FILE).read_text(encoding="utf-8") if is_main else None)
        with survive.together(accelerator):
            check_shared_folder(run_dir, stamp)
    with survive.together(accelerator):  # "already holds a run": every process stops here, the main one says it
        claim_run_dir(run_dir, resume=resume, overwrite=overwrite, delete=is_main)
    accelerator.wait_for_everyone()

    with count_load_skips() as load_skips:  # rows dropped at load (an unreadable image), counted below
        tasks, stream = load_prompt_stream(cfg)
    eval_sets = load_eval_sets(cfg, tasks)
    with survive.together(accelerator):  # a task that needs a judge the settings do not give: every process stops
        judge = judge_for(cfg.judge, tasks.values(), run_dir)
    max_images, max_videos, tool_images = media_room(cfg, tasks, stream.samples)
    if max_videos or tool_images:  # the start's check counted no video tokens nor crops: again, with the data's
        check_tree_fits(cfg, accelerator, videos_per_prompt=max_videos, tool_images_per_thought=tool_images)

    with survive.together(accelerator):  # the main process chooses the checkpoint; the others load that one
        last, history_state = checkpoint_to_resume(run_dir, resume) if is_main else (None, None)
    if num_processes > 1:
        last = main_process_value(accelerator, last)
        with survive.together(accelerator):
            if not is_main and last is not None:
                try:
                    history_state = ckpt.load_resumable_state(last)
                except ckpt.CheckpointLoadError as error:  # it loaded on the main process: not one folder
                    raise ConfigError(f"--resume: {error}, where the main process loaded it") from None
    policy = load_training_policy(cfg, last, accelerator.device)
    start_step = history_state["step"] if history_state is not None else 0
    scorer = CompletionScorer(policy, share_prefixes=shares_prefixes(cfg))
    fsdp = sharding.launch_settings() if num_processes > 1 else None
    if fsdp is not None:  # FSDP2: sharded here, before the optimizer sees the parameters; not DDP-wrapped
        scorer = sharding.shard(scorer, fsdp, accelerator.device)
    optimizer = make_optimizer(lora.trainable_parameters(policy.model), cfg)
    # The scheduler stays out of accelerator.prepare: a prepared scheduler steps once per process at every
    # step() (N processes: the schedule runs N times too fast). It is stepped once per training step here.
    scheduler = make_scheduler(optimizer, cfg)
    if fsdp is None:
        scorer, optimizer = accelerator.prepare(scorer, optimizer)
    else:
        optimizer = accelerator.prepare(optimizer)
    reference = make_reference(policy, scorer, cfg, accelerator.device, fsdp)
    spikes = GradSpikeMonitor()
    if history_state is not None:
        configured = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        if history_state["optimizer"] == sharding.SHARDED_OPTIMIZER:
            sharding.load_optimizer(scorer, optimizer, last)
        else:
            optimizer.load_state_dict(history_state["optimizer"])
        # With its state torch puts back the checkpoint's learning rate, betas and weight decay, and a loaded
        # scheduler its base rate: a resume that changed them would go on with the old ones. The run's own
        # settings go back over them, and the schedule continues from the step reached.
        for group, settings in zip(optimizer.param_groups, configured, strict=True):
            group.update(settings)
        scheduler = make_scheduler(scheduler.optimizer, cfg, steps_done=start_step)
        try:
            stream.load_state_dict(history_state["data"])
        except ValueError as error:  # another task or data source than the checkpoint's (--allow-changes)
            raise ConfigError(
                f"--resume from {last}: {error}. The data position cannot carry over to other data; to train on it"
                f" from these weights, start a new run with model.name_or_path={last / 'model'}"
            ) from None
        ckpt.set_rng_state(history_state["rng"])
        if "spikes" in history_state:
            spikes.load_state_dict(history_state["spikes"])
        log.info("resumed from %s at step %d", last, start_step)

    with survive.together(accelerator):  # a folder the main process cannot write stops every process here
        if accelerator.is_main_process:
            try:
                save_config(cfg, run_dir / CONFIG_FILE, history=resume_history(run_dir, cfg, start_step) if resume else [])
            except OSError as error:  # its lock was writable (held since before), the folder is not
                raise folder_refused(run_dir, f"write its {CONFIG_FILE}", error) from None
    if accelerator.is_main_process:
        drop_records_after(run_dir, start_step)  # a resumed run logs the steps after its checkpoint again
        log.info(
            "model %s (%s, %d parameters, attention %s, coordinate frame %s); tasks %s with %d samples; "
            "K=%d thoughts x M=%d answers; %d process(es) of %d prompts each",
            cfg.model.name_or_path,
            type(policy.model).__name__,
            count_parameters(policy.model),
            policy.model.config._attn_implementation,
            policy.frame.value,
            ", ".join(f"{name} ({weight:g})" for name, weight in cfg.task_weights.items()),
            len(stream.samples),
            cfg.rollout.num_thoughts,
            cfg.rollout.num_answers,
            num_processes,
            cfg.train.prompts_per_step // num_processes,
        )
    trackers = open_trackers(  # only the main process logs
        cfg.logging.report_to if accelerator.is_main_process else [], run_dir, project=cfg.logging.project,
        run_name=cfg.logging.run_name, tags=cfg.logging.tags, offline=cfg.logging.offline,
        params=run_params(cfg.to_dict()) if accelerator.is_main_process else {}, start_step=start_step,
    )  # fmt: skip
    logger = RunLogger(
        run_dir,
        trackers=trackers,
        progress_bar=cfg.logging.progress_bar and accelerator.is_main_process,
        total_steps=cfg.train.steps,
        start_step=start_step,
        rollout_every=cfg.logging.rollout_every,
    )
    counters = Counter(history_state["counters"]) if history_state else Counter()
    for reason, n in load_skips.items():  # set, not added: a resumed run has loaded (and skipped) them again
        counters[f"skipped_{reason}_at_load"] = n
    # Last, so that nothing between here and train()'s try can fail with an engine to end (close). After a
    # resume's weights are loaded: the engine gets those. Room for the most images any training prompt holds, and
    # a crop per tool turn where a task has tools.
    if split is not None:  # the engine processes sample; a resume discards the trees they had sampled ahead
        engine = RemoteEngine(cfg, *split, start_step=start_step, stream_state=stream.state_dict(), policy=policy)
        counters["in_flight_trees_discarded"] += in_flight_at_resume(cfg, start_step) if history_state else 0
    else:
        engine = make_engine(cfg, policy, max_images=max_images + tool_images, max_videos=max_videos, num_processes=num_processes, process_index=accelerator.process_index)  # fmt: skip
    return RunState(
        cfg=cfg, accelerator=accelerator, run_dir=run_dir, tasks=tasks, stream=stream, eval_sets=eval_sets,
        policy=policy, scorer=scorer, optimizer=optimizer, scheduler=scheduler, reference=reference, fsdp=fsdp,
        logger=logger, counters=counters, spikes=spikes, start_step=start_step,
        prompts_per_process=cfg.train.prompts_per_step // num_processes, engine=engine, run_lock=run_lock, judge=judge,
    )  # fmt: skip


def make_optimizer(parameters, cfg: Config) -> torch.optim.Optimizer:
    if cfg.train.optimizer == "sgd":  # plain SGD: the update is the gradient times the learning rate
        return torch.optim.SGD(parameters, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    return torch.optim.AdamW(
        parameters, lr=cfg.train.learning_rate, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2), weight_decay=cfg.train.weight_decay
    )


def make_scheduler(optimizer, cfg: Config, steps_done: int = 0):
    """The learning rate of step s (0-based) is learning_rate * factor(s): linear warmup over warmup_steps,
    then constant, linear decay to 0 at train.steps, or cosine decay. ``steps_done``: a resumed run's steps,
    so its next step gets factor(steps_done)."""
    total, warmup = cfg.train.steps, cfg.train.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if cfg.train.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.train.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=steps_done - 1)


def configure_trainable(policy: Policy, cfg: Config) -> None:
    """LoRA adapters (unless the loaded checkpoint already has them) and the frozen vision tower."""
    if cfg.model.lora_rank > 0 and policy.adapter is None:
        name = cfg.model.name_or_path
        base = name if name == "tiny" or not Path(name).exists() else str(Path(name).resolve())
        try:
            policy.adapter = lora.apply_lora(
                policy.model,
                rank=cfg.model.lora_rank,
                alpha=cfg.model.lora_alpha,
                dropout=cfg.model.lora_dropout,
                target_modules=cfg.model.lora_target_modules,
                base_model_name_or_path=base,
            )
        except ValueError as error:  # targets a model not described in architectures.py does not have
            raise ConfigError(f"model.lora_target_modules={cfg.model.lora_target_modules}: {error}") from None
    elif cfg.model.lora_rank == 0 and policy.adapter is not None:
        raise ConfigError("the checkpoint holds a LoRA adapter but model.lora_rank=0; resume with its LoRA settings")
    if cfg.model.freeze_vision:
        lora.freeze_vision(policy.model)
    log.info("trainable: %s", lora.describe_parameters(policy.model))


def shares_prefixes(cfg: Config) -> bool:
    """Training forwards encode each prompt and thought once (through the KV cache) unless gradient
    checkpointing is on: transformers drops the cache under checkpointing, so those rows are re-encoded."""
    return not cfg.model.gradient_checkpointing


def make_reference(policy: Policy, scorer: torch.nn.Module, cfg: Config, device, fsdp=None):
    """``reference(micro, prompts, accelerator, temperature)`` -> log-probs of the frozen reference policy (KL
    term), or None without KL; computed by ``score_rows`` like the trained log-probs. With LoRA the reference
    is the trained scorer with its adapters switched off (no second copy in memory); otherwise a frozen copy of
    ``model.name_or_path``, loaded as the policy was, sharded like the policy under FSDP (``fsdp``: its
    settings) and then ``reference.module``."""
    if cfg.algorithm.kl_coef == 0:
        return None
    if policy.adapter is not None:
        reference_scorer, switch = scorer, lambda: lora.adapters_disabled(policy)
    else:
        frozen = load_model_policy(cfg, cfg.model.name_or_path, device)
        frozen.model.eval().requires_grad_(False)
        reference_scorer, switch = CompletionScorer(frozen, share_prefixes=shares_prefixes(cfg)), contextlib.nullcontext
        if fsdp is not None:
            reference_scorer = sharding.shard(reference_scorer, fsdp, device, trains=False)

    def reference(micro: TrainBatch, prompts, accelerator, temperature: float) -> torch.Tensor:
        with torch.no_grad(), switch():
            return score_rows(reference_scorer, micro, prompts, accelerator, temperature)

    reference.module = None if reference_scorer is scorer else reference_scorer  # a model of its own
    return reference


def load_prompt_stream(cfg: Config) -> tuple[dict[str, Task], PromptStream | TaskMixture]:
    """The run's tasks and their seeded prompt stream (a TaskMixture when data.tasks mixes several).
    Raises ConfigError naming the task, split and source when data cannot be loaded."""
    import_task_modules(cfg.data.task_modules)
    tasks = {name: get_task(name) for name in cfg.task_weights}
    try:  # fail now, not mid-run, on an unknown part name
        check_reward_overrides(list(tasks.values()), cfg.data.reward_weights)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    streams = {}
    for name, task in tasks.items():
        source = cfg.task_source(name)
        try:
            streams[name] = PromptStream(load_samples(task, cfg.data.split, source), seed=cfg.train.seed)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"data.task={name} data.split={cfg.data.split} data.source={source}: {error}") from error
    if not cfg.data.tasks:
        return tasks, streams[cfg.data.task]
    return tasks, TaskMixture(streams, cfg.data.tasks, seed=cfg.train.seed)


def load_model_policy(cfg: Config, model_path: str, device) -> Policy:
    """A model as ``cfg.model`` says to load it (dtype, attention, image bounds): the trained policy and the
    frozen KL reference load through here, so they compute alike."""
    try:
        return load_policy(
            model_path,
            dtype=cfg.model.dtype,
            attn_implementation=cfg.model.attn_implementation,
            min_pixels=cfg.model.min_pixels,
            max_pixels=cfg.model.max_pixels,
            device=device,
            video_budget=VideoBudget(cfg.model.video_fps, cfg.model.video_max_frames, cfg.model.video_max_pixels),
        )
    except (FileNotFoundError, ValueError) as error:  # a missing folder, an unsupported model family
        raise ConfigError(f"model.name_or_path={model_path}: {error}") from error


def load_training_policy(cfg: Config, last: Path | None, device) -> Policy:
    """The policy to train: ``model.name_or_path``, or the model of checkpoint ``last`` when resuming (which
    may be a LoRA adapter over its base); LoRA and frozen parts configured."""
    model_path = str(last / "model") if last is not None else cfg.model.name_or_path
    policy = load_model_policy(cfg, model_path, device)
    policy.model.train()
    policy.model.config.use_cache = True
    if cfg.model.gradient_checkpointing:
        policy.model.activation_checkpointing_enable()
    configure_trainable(policy, cfg)
    check_video_max_pixels(cfg.model.video_max_pixels, policy.patch_factor, model_path)  # config.validate checked the smallest factor only
    return policy

