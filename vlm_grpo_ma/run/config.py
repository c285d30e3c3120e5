"""One typed config tree: dataclass defaults (= the embedded default run), a YAML file, dotted CLI overrides.

``load_config(path, overrides)`` merges, type-checks and validates; every error names the key and, where
the value must be one of a set, the valid choices. Derived values are computed (``Config.answers_per_prompt``),
never stored twice.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo_ma.algorithm.advantages import ADVANTAGE_ESTIMATORS
from vlm_grpo_ma.algorithm.loss import LOSS_AGGREGATIONS, POLICY_LOSSES
from vlm_grpo_ma.engines.decode import SEED_STRIDE
from vlm_grpo_ma.task_api.judge import VERDICT_FORMATS
from vlm_grpo_ma.task_api.videos import VideoBudget


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and the valid choices."""


# What a resumed run takes from its checkpoint. A setting that shapes one of them says so in its field's metadata
# (``field(..., metadata=shapes("optimizer"))``), next to its default, so a new setting is classed where it is
# added: a --resume that changes one continues another run, refused unless --allow-changes, and refused even
# then for the parts a resume always takes from the checkpoint (``CARRIED_AS_SAVED``), where the change could
# not take effect (run_dir.resumed_settings; ``checkpoint_state_keys`` lists them).
CHECKPOINT_STATE = {
    "model": "the trained weights",
    "adapter": "the LoRA adapter (with the rank, targets, scaling and dropout it was made with)",
    "trainable": "which parameters train (the optimizer holds state for each)",
    "optimizer": "the optimizer's state (AdamW's moments feed no other optimizer)",
    "data": "the data stream's position",
    "randomness": "the run's random streams (data order and sampling seeds, restored from the checkpoint)",
    "objective": "the objective the steps so far trained on",
}
CARRIED_AS_SAVED = ("model", "adapter", "trainable", "optimizer", "randomness")


def shapes(part: str) -> dict[str, str]:
    """The field metadata of a setting that shapes ``part`` of a checkpoint (a key of ``CHECKPOINT_STATE``)."""
    if part not in CHECKPOINT_STATE:
        raise ValueError(f"{part!r} is no part of a checkpoint; valid: {', '.join(CHECKPOINT_STATE)}")
    return {"shapes": part}


@dataclass
class ModelConfig:
    name_or_path: str = field(default="tiny", metadata=shapes("model"))  # "tiny" = the embedded model; else a hub id or local path of a Qwen-VL model
    dtype: str = "float32"  # the weights' dtype: float32 or bfloat16 (float16 is refused)
    attn_implementation: str = "auto"  # auto: flash_attention_2 when installed on a GPU, else sdpa
    min_pixels: int | None = None  # each image resized to at least this many pixels (None: the processor's own bound)
    max_pixels: int | None = None  # each image resized to at most this many pixels (None: the processor's own bound)
    video_fps: float = VideoBudget.fps  # each video (task_api/videos.py): frames sampled a second
    video_max_frames: int = VideoBudget.max_frames  # each video: at most this many frames (evenly over a longer clip; logged once)
    video_max_pixels: int = VideoBudget.max_pixels  # each video frame resized to at most this many pixels
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory, and prompts and thoughts re-encoded per row
    # keep the vision tower (and its merger) fixed and train the language model only; false trains it too
    freeze_vision: bool = field(default=True, metadata=shapes("trainable"))
    lora_rank: int = field(default=0, metadata=shapes("adapter"))  # > 0: train LoRA adapters of this rank (peft) instead of all weights
    lora_alpha: float = field(default=32.0, metadata=shapes("adapter"))  # LoRA's scale: adapters count lora_alpha / lora_rank
    lora_dropout: float = field(default=0.0, metadata=shapes("adapter"))  # dropout on the adapters' input
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata=shapes("adapter"),
    )  # module-name suffixes in the language model that get adapters


@dataclass
class RolloutConfig:
    num_thoughts: int = field(default=4, metadata=shapes("objective"))  # K: thoughts sampled per prompt
    num_answers: int = field(default=4, metadata=shapes("objective"))  # M: answers sampled per thought; 1 = plain GRPO
    max_thought_tokens: int = 40  # a thought's token budget; one that reaches it gets a forced thought_stop
    max_answer_tokens: int = 24  # an answer's token budget
    temperature: float = 1.0  # sampling temperature (the trainer's log-probs are computed at it too)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability (1 = all)
    # A thought that reaches max_thought_tokens gets a forced "</think>". close: its answers are scored and trained
    # normally; zero: its answers score 0 (the thought's penalty) and are not trained on (rollout.answers_void).
    truncated_thoughts: str = field(default="close", metadata=shapes("objective"))
    thought_stop: str = "</think>"  # the text that ends a thought (stage 1 stops there, stage 2 continues)
    answer_stop: str = "</answer>"  # the text that ends an answer
    max_turns: int = 3  # tool calls a thought may make (tasks with tools); one more closes it, out of the loss, counted
    reward_workers: int = 8  # worker processes scoring answers (each reward call runs in one)
    reward_timeout_s: float = 30.0  # deadline of one reward call; past it: killed, scored 0, count/reward_timeouts
    # What samples the K x M tree (vlm_grpo_ma/engines): hf (the KV-branching decode loop of engines/decode.py, the
    # default) or vllm (an in-process vLLM engine in every process of a launch: `scripts/setup.sh --vllm`; docs/VLLM.md).
    engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.35  # the share of GPU memory the engine takes (weights + KV cache)
    vllm_kv_cache_gib: float = 1.0  # CPU build only: its KV cache size, whole GiB (VLLM_CPU_KVCACHE_SPACE)
    vllm_tensor_parallel_size: int = 1  # processes per engine: groups of this many consecutive processes share one
    vllm_sleep: bool = False  # GPU only: free the engine's memory, weights too, during the update (sleep level 2)
    engine_processes: int = 0  # the last this many processes of a launch only sample, the others only train (docs/SCALING.md)
    max_staleness: int = 0  # engine processes sample with weights up to this many updates old (0: they wait for each update)


@dataclass
class AlgorithmConfig:
    # How rewards [B, K, M] become thought and answer advantages (advantages.ADVANTAGE_ESTIMATORS). grpo_ma: a
    # thought's mean reward normalised over the prompt's K thoughts, each answer's reward over answer_baseline's
    # group; a thought is one sequence of the objective, trained once. grpo: plain GRPO over the K*M (thought,
    # answer) sequences, each normalised over the prompt's K*M, a thought trained in each of its M sequences
    # with that sequence's advantage (exactly re-encoding the K*M; needs answer_baseline=prompt).
    advantage_estimator: str = field(default="grpo_ma", metadata=shapes("objective"))
    # The group an answer's reward is normalised over. "thought" (the default): its thought's M answers, so answer
    # tokens are pushed only by what they control given the thought (needs M >= 2); it gained the most held-out
    # IoU on the embedded task (docs/TUNING.md). "prompt" (GRPO-MA's paper, the GPU presets): the prompt's K*M
    # answers; with M = 1 that is plain GRPO.
    answer_baseline: str = field(default="thought", metadata=shapes("objective"))
    scale_by_std: bool = field(default=True, metadata=shapes("objective"))  # false: Dr.GRPO's advantages (reward minus the group mean, no std division)
    std_unbiased: bool = False  # true: the Bessel-corrected std (n - 1, as TRL); false: the population std (n)
    eps: float = 1e-6  # added to the std before dividing (verl, TRL); a group of equal rewards gets 0 regardless
    # The per-token policy loss (loss.POLICY_LOSSES): ppo (clipped surrogate), gspo (sequence-level ratio,
    # length-normalised; GSPO as published also sets loss_aggregation=sequence and clips at 3e-4/4e-4), cispo
    # (clipped, stop-gradient importance weight times the log-prob; clip_low=1 leaves the lower side open as
    # MiniMax-M1 does).
    policy_loss: str = field(default="ppo", metadata=shapes("objective"))
    clip_low: float = 0.2  # the ratio's lower clip is 1 - clip_low (PPO's epsilon)
    clip_high: float = 0.28  # asymmetric ("clip-higher", DAPO arXiv 2503.14476)
    kl_coef: float = field(default=0.0, metadata=shapes("objective"))  # > 0 loads a frozen reference policy and adds k3 KL
    # policy updates per rollout. With 1 the importance ratio is exactly 1 and clip_low/clip_high have no effect;
    # > 1 reuses the rollout and the ratio and clipping act from the second update on.
    num_iterations: int = 1
    # How the step's tokens are weighted (loss.LOSS_AGGREGATIONS); the weights sum to 1 over the step (dr_grpo's
    # to at most 1). token: one mean over every trained token (DAPO). sequence: each sequence averaged over its tokens,
    # then sequences averaged (GRPO as published; on GRPO-MA's tree thoughts and answers are two halves).
    # dr_grpo: sequence with a constant length, the maximum (Dr.GRPO; pair with scale_by_std=false).
    # sequence is the default: under token averaging a T4A4 thought's tokens get 16% of the gradient against its
    # M answers' tokens, and the embedded run learns more slowly (docs/TUNING.md, "Sequence averaging").
    loss_aggregation: str = field(default="sequence", metadata=shapes("objective"))
    # DAPO's dynamic sampling: drop prompt groups whose K*M task rewards are all equal (no signal) and draw more
    # prompts, up to dynamic_sampling_max_draws extra draws of train.prompts_per_step prompts, until the draws hold
    # prompts_per_step informative groups (short of that, uninformative ones fill the step; both are counted).
    dynamic_sampling: bool = False
    dynamic_sampling_max_draws: int = 4  # dynamic_sampling: at most this many extra draws a step
    # DAPO's soft overlong punishment: within the last N tokens before rollout.max_thought_tokens /
    # rollout.max_answer_tokens the reward falls linearly, by up to overlong_penalty at the limit. 0 = off.
    overlong_buffer_thought_tokens: int = field(default=0, metadata=shapes("objective"))
    overlong_buffer_answer_tokens: int = field(default=0, metadata=shapes("objective"))  # the same ramp for answers (0 = off)
    overlong_penalty: float = field(default=1.0, metadata=shapes("objective"))  # the reward lost at the token limit
    # Correcting for the sampling engine's log-probs differing from the trainer's (bf16 engines): none, or tis
    # (truncated importance sampling: each token's loss times min(exp(old - engine), rollout_correction_cap)).
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0  # tis: the largest importance weight a token's loss gets (>= 1)


@dataclass
class DataConfig:
    task: str = field(default="grounding", metadata=shapes("data"))  # one task; or leave it and set `tasks` to mix several
    # a mixture {name: weight}; replaces `task` when set
    tasks: dict[str, float] = field(default_factory=dict, metadata=shapes("data"))
    split: str = field(default="train", metadata=shapes("data"))  # the split of the data the run trains on
    source: str | None = field(default=None, metadata=shapes("data"))  # a local file in a format `task` loads; None = the embedded data
    # with `tasks`: {name: file}; unnamed tasks embedded
    sources: dict[str, str] = field(default_factory=dict, metadata=shapes("data"))
    eval_split: str = "test"  # held-out embedded split evaluated every train.eval_every steps
    eval_sources: dict[str, str] = field(default_factory=dict)  # {task: file} held-out files instead
    task_modules: list[str] = field(default_factory=list)  # extra task modules (dotted names or .py paths)
    # override the task's default weights
    reward_weights: dict[str, float] = field(default_factory=dict, metadata=shapes("objective"))


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps (one rollout of prompts_per_step prompts each)
    prompts_per_step: int = field(default=16, metadata=shapes("data"))  # B; rows per step = B * K * M
    micro_batch_rows: int = 32  # answer rows per forward/backward
    learning_rate: float = 2e-4  # the optimizer's learning rate (after warmup; see lr_schedule)
    optimizer: str = field(default="adamw", metadata=shapes("optimizer"))  # adamw, or sgd (plain, no momentum: used by the equivalence checks)
    weight_decay: float = 0.0  # the optimizer's weight decay (AdamW: decoupled)
    adam_beta1: float = 0.9  # AdamW's decay of its gradient average
    adam_beta2: float = 0.99  # AdamW's decay of its squared-gradient average
    lr_schedule: str = "constant"  # after the warmup: constant, linear (to 0 at train.steps) or cosine
    warmup_steps: int = 0  # the learning rate rises linearly over this many first steps
    # clip the gradient's global norm to this; must be > 0 (0 would zero every update while the logged norm
    # looks normal). No "off" value: a large one (1e9) leaves the gradients as they are.
    max_grad_norm: float = 1.0
    seed: int = field(default=0, metadata=shapes("randomness"))  # 0 .. max_seed(steps), about 1.84e7: the sampling seeds must fit in 64 bits
    output_dir: str | None = None  # None: runs/<task>-<model> (default_output_dir), e.g. runs/grounding-tiny
    checkpoint_every: int = 50  # a checkpoint every N steps, at the end, and when a run stops (Ctrl-C, SIGTERM, an error)
    keep_checkpoints: int = 2  # the newest this many checkpoints are kept, older ones deleted
    # torch's CPU threads in each process; 0 = torch's default (one per core). On a machine other jobs share, 1: a
    # step went from 1.3 s to 35-54 s at two threads beside another run (a CPU run warns at start; docs/TUNING.md)
    num_threads: int = 0
    mixed_precision: str = "no"  # "bf16": autocast through accelerate (GPU); weights stay in model.dtype
    eval_every: int = 100  # greedy evaluation on data.eval_split before step 1 and every N steps (0 = never)
    eval_samples: int = 100  # held-out samples per task in each evaluation


@dataclass
class LoggingConfig:
    log_every: int = 1  # a metrics.jsonl record every N steps (and at each evaluation and the last step)
    rollout_samples_per_step: int = 2  # rollouts dumped to rollouts.jsonl per step (and rows of the completions table)
    # Where the metrics also go (trackers.TRACKERS): tensorboard, wandb, mlflow, swanlab, trackio; [] or [none]:
    # metrics.jsonl only. All but tensorboard need `pip install -e .[trackers]`.
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "vlm-grpo-ma"  # the trackers' project (MLflow: experiment)
    run_name: str | None = None  # None: the name of train.output_dir
    tags: list[str] = field(default_factory=list)  # the trackers' run tags
    # true: W&B and SwanLab in their offline modes, MLflow in a SQLite file of the run folder, trackio local; no
    # network. false: each library's own settings (WANDB_MODE, MLFLOW_TRACKING_URI, SWANLAB_MODE, ...).
    offline: bool = True
    rollout_every: int = 10  # a completions table to the trackers every N steps (0: never)
    eval_drawings: int = 4  # held-out images drawn per task at each evaluation (eval/step-N/draw/, and trackers)
    progress_bar: bool = True  # a progress bar on the terminal (the main process's)


@dataclass
class JudgeConfig:
    """A served judge model for tasks whose rewards need one (``Task.judge_query``; docs/JUDGE.md)."""

    base_url: str | None = None  # an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (`vllm serve`)
    model: str = field(default="", metadata=shapes("objective"))  # the served model's name, as GET /models lists it
    api_key_env: str | None = None  # the environment variable that holds the API key (never the key itself)
    verdict: str = field(default="yes_no", metadata=shapes("objective"))  # yes_no, or score (an integer 0-10)
    send_images: bool = field(default=False, metadata=shapes("objective"))  # send the image file too (a judge that takes images)
    constrain_verdict: bool = False  # vLLM servers only: the reply restricted to the verdict's words (structured outputs)
    max_in_flight: int = 8  # requests at a time, per process
    request_timeout_s: float = 20.0  # one request; every verdict of a step also waits at most rollout.reward_timeout_s
    retries: int = 2  # retries of a request refused for load (HTTP 429, 5xx), timed out or not connected
    max_answer_chars: int = field(default=500, metadata=shapes("objective"))  # a longer answer is not sent: scores 0
    max_tokens: int = 4  # tokens the judge may write (the verdict is one word or number)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    @property
    def task_weights(self) -> dict[str, float]:
        """The run's tasks and their mixing weights (one task: ``{data.task: 1.0}``)."""
        return dict(self.data.tasks) if self.data.tasks else {self.data.task: 1.0}

    def task_source(self, name: str) -> str | None:
        return self.data.sources.get(name) if self.data.tasks else self.data.source

    @property
    def answers_per_prompt(self) -> int:
        return self.rollout.num_thoughts * self.rollout.num_answers

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def checkpoint_state_keys() -> dict[str, str]:
    """``{"section.key": part}`` of every setting that shapes a part of a checkpoint (``CHECKPOINT_STATE``)."""
    return {
        f"{section.name}.{item.name}": item.metadata["shapes"]
        for section in dataclasses.fields(Config)
        for item in dataclasses.fields(section.default_factory)
        if "shapes" in item.metadata
    }


CHOICES = {
    "model.dtype": ("float32", "bfloat16"),  # float16 is refused with its reason in validate()
    "model.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "rollout.truncated_thoughts": ("close", "zero"),
    "rollout.engine": ("hf", "vllm"),
    "algorithm.rollout_correction": ("none", "tis"),
    "algorithm.advantage_estimator": tuple(ADVANTAGE_ESTIMATORS),
    "algorithm.answer_baseline": ("prompt", "thought"),
    "algorithm.loss_aggregation": tuple(LOSS_AGGREGATIONS),
    "algorithm.policy_loss": tuple(POLICY_LOSSES),
    "train.optimizer": ("adamw", "sgd"),
    "train.lr_schedule": ("constant", "linear", "cosine"),
    "train.mixed_precision": ("no", "bf16"),  # fp16 is refused with its reason in validate()
    "judge.verdict": VERDICT_FORMATS,
}
POSITIVE = (
    "rollout.num_thoughts",
    "rollout.num_answers",
    "rollout.max_thought_tokens",
    "rollout.max_answer_tokens",
    "rollout.temperature",
    "rollout.reward_workers",
    "rollout.reward_timeout_s",
    "rollout.vllm_gpu_memory_utilization",
    "rollout.vllm_kv_cache_gib",
    "rollout.vllm_tensor_parallel_size",
    "algorithm.rollout_correction_cap",
    "algorithm.num_iterations",
    "train.steps",
    "train.prompts_per_step",
    "train.micro_batch_rows",
    "train.learning_rate",
    "train.max_grad_norm",
    "train.eval_samples",  # 0 would divide by zero in the first evaluation
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "logging.log_every",
    "model.min_pixels", "model.max_pixels", "model.video_fps", "model.video_max_pixels",
    "judge.max_in_flight", "judge.request_timeout_s", "judge.max_answer_chars", "judge.max_tokens",
)
NON_NEGATIVE = (
    "algorithm.eps", "algorithm.clip_low", "algorithm.clip_high",
    "algorithm.kl_coef", "algorithm.dynamic_sampling_max_draws", "algorithm.overlong_buffer_thought_tokens",
    "algorithm.overlong_buffer_answer_tokens", "algorithm.overlong_penalty", "model.lora_rank", "model.lora_dropout",
    "rollout.engine_processes", "rollout.max_staleness",
    "train.weight_decay",
    "train.warmup_steps",
    "train.num_threads",
    "train.eval_every",
    "logging.rollout_samples_per_step",
    "logging.rollout_every",
    "logging.eval_drawings",
    "train.seed",
    "judge.retries", "rollout.max_turns",
)
# Keys that were renamed: the error says what to write instead.
REPLACED_KEYS = {
    "logging.tensorboard": "list the trackers in logging.report_to (e.g. logging.report_to=[tensorboard], or [] for none)",
}
# Integers far beyond any sensible run overflow torch/numpy calls mid-start with a traceback; refuse them.
MAX_INT = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# logits / temperature must stay finite in float32 for logits in the hundreds: 1e-4 keeps 1e6 of headroom.
MIN_TEMPERATURE = 1e-4
# Each prompt samples from a torch generator seeded with (train.seed * SEED_STRIDE + step) * SEED_STRIDE +
# prompt (engines.decode.SEED_STRIDE); torch's manual_seed takes at most 2**64 - 1. Seeds up to numpy's
# 2**32 - 1 passed validation and overflowed at step 1 ("Overflow when unpacking long long"), after the model
# and data had loaded: max_seed is the bound for the run's steps and prompts.


def max_seed(steps: int) -> int:
    """The largest ``train.seed`` whose sampling seeds fit in 64 bits for every step of a run of ``steps``
    steps, with room for SEED_STRIDE - 1 prompts a step, any redraws included (about 1.84e7 for any run of
    under a million steps)."""
    largest_offset = max(steps, 1) * SEED_STRIDE - 1  # step steps - 1, prompt SEED_STRIDE - 1
    return (2**64 - 1 - largest_offset) // SEED_STRIDE**2


def _numbers(cfg: Config):
    """(dotted key, value) of every int/float value in the tree, dict entries included (``data.tasks.vqa``)."""
    for section in dataclasses.fields(cfg):
        for item in dataclasses.fields(getattr(cfg, section.name)):
            key, value = f"{section.name}.{item.name}", getattr(getattr(cfg, section.name), item.name)
            values = value.items() if isinstance(value, dict) else [(None, value)]
            for name, v in values:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    yield (key if name is None else f"{key}.{name}"), v


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def model_label(name_or_path: str) -> str:
    """A short name of a model for folder names: ``tiny``, a folder's or hub id's last part, or ``RUN-step-N``
    for a checkpoint's model folder."""
    path = Path(name_or_path.rstrip("/"))
    if path.name == "model" and path.parent.parent.name == "checkpoints":
        return f"{path.parent.parent.parent.name}-{path.parent.name}"
    return path.name or name_or_path


def default_output_dir(cfg: Config) -> str:
    """``runs/<task>-<model>`` (a mixture: its tasks joined by ``+``), so runs of other tasks or models do not
    land in one folder."""
    tasks = "+".join(sorted(cfg.data.tasks)) if cfg.data.tasks else cfg.data.task
    return f"runs/{tasks}-{model_label(cfg.model.name_or_path)}"


# Pixels per side of one vision token (patch size x merge size) of the model families the trainer runs: 28 on
# Qwen2/2.5-VL (14 x 2), 32 on Qwen3-VL and Qwen3.5 (16 x 2). A video frame is resized to whole tokens
# (task_api/videos.py, qwen-vl-utils' smart_resize, which asserts max_pixels >= one token's factor x factor).
SMALLEST_PATCH_FACTOR = 28


def check_video_max_pixels(
    video_max_pixels: int, factor: int = SMALLEST_PATCH_FACTOR, model: str | None = None, key: str = "model.video_max_pixels"
) -> None:
    """ConfigError when ``video_max_pixels`` (``key``: its name in the message) is below one vision token of
    ``factor`` x ``factor`` pixels: no frame fits, and the first video would fail mid-run. ``validate`` checks the
    smallest factor; the run and ``evaluate``, once a model is loaded, that model's own (``model``: its name)."""
    if video_max_pixels < factor * factor:
        raise ConfigError(
            f"{key}={video_max_pixels} must be >= {factor * factor}, one vision token"
            f" ({factor}x{factor} pixels{f' on {model}' if model else ''}): each video frame is resized to whole"
            " tokens, and a smaller budget holds none"
        )


def validate(cfg: Config) -> Config:
    # NaN passes neither `> 0` nor `>= 0` but inf passes both; an infinite learning rate, reward or task weight
    # would train on NaN weights (or on one task only), so every number must be finite.
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
        if isinstance(value, float) and abs(value) > FLOAT32_MAX:  # rewards, advantages and losses are float32
            raise ConfigError(f"{key}={value!r} is infinite in float32 (the trainer's tensors); at most {FLOAT32_MAX:.3g}")
        if isinstance(value, int) and key != "train.seed" and abs(value) > MAX_INT:
            raise ConfigError(f"{key}={value} is out of range (at most {MAX_INT})")
    if cfg.train.mixed_precision == "fp16":
        raise ConfigError(
            "train.mixed_precision=fp16 is not supported: the trainer has no loss scaling (the first overflow"
            " would stop the run, and FSDP would clip still-scaled gradients); use bf16 (or no)"
        )
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype=float16 is not supported: AdamW's eps (1e-8) is 0 in float16, so a weight whose gradient is"
            " 0 becomes 0/0 = NaN at the first update (the run stops at step 1 even when every advantage is 0), and"
            " the trainer has no loss scaling; use bfloat16 (or float32)"
        )
    for key, choices in CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not valid; choose one of: {', '.join(choices)}")
    for key in POSITIVE:
        if _get(cfg, key) is not None and not _get(cfg, key) > 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be > 0")
    for key in NON_NEGATIVE:
        if _get(cfg, key) is not None and not _get(cfg, key) >= 0:
            raise ConfigError(f"{key}={_get(cfg, key)!r} must be >= 0")
    highest_seed = max_seed(cfg.train.steps)
    if not 0 <= cfg.train.seed <= highest_seed:
        raise ConfigError(
            f"train.seed={cfg.train.seed} is out of range: valid seeds are 0 .. {highest_seed} (each prompt's"
            f" sampling seed, (seed * {SEED_STRIDE} + step) * {SEED_STRIDE} + prompt, must fit in 64 bits)"
        )
    if None not in (cfg.model.min_pixels, cfg.model.max_pixels) and cfg.model.min_pixels > cfg.model.max_pixels:
        raise ConfigError(f"model.min_pixels={cfg.model.min_pixels} must be <= model.max_pixels={cfg.model.max_pixels}")
    check_video_max_pixels(cfg.model.video_max_pixels)
    if cfg.model.video_max_frames < 2:  # the vision tower takes frames in pairs (its temporal patch)
        raise ConfigError(f"model.video_max_frames={cfg.model.video_max_frames} must be >= 2")
    draws = 1 + cfg.algorithm.dynamic_sampling_max_draws if cfg.algorithm.dynamic_sampling else 1
    if draws * cfg.train.prompts_per_step > SEED_STRIDE:
        raise ConfigError(
            f"algorithm.dynamic_sampling_max_draws={cfg.algorithm.dynamic_sampling_max_draws} with"
            f" train.prompts_per_step={cfg.train.prompts_per_step} draws more than {SEED_STRIDE} prompts a step, the"
            " most the sampling seeds number apart"
        )
    if not cfg.algorithm.clip_low <= 1:
        raise ConfigError(
            f"algorithm.clip_low={cfg.algorithm.clip_low!r} must be in [0, 1] (the ratio's lower bound is 1 - clip_low;"
            " 1 leaves it open)"
        )
    if cfg.rollout.engine == "vllm" and cfg.rollout.top_p < 1:
        raise ConfigError(
            f"rollout.top_p={cfg.rollout.top_p!r}: rollout.engine=vllm reports log-probs renormalised over the nucleus,"
            " while the trainer scores the whole distribution, so the log-prob gap and the TIS weights would measure"
            " the nucleus, not the engine; use rollout.top_p=1 or rollout.engine=hf"
        )
    if cfg.rollout.temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"rollout.temperature={cfg.rollout.temperature!r} is below {MIN_TEMPERATURE:g}: the sampler divides float32"
            " logits by it, which overflows to inf and samples NaN"
        )
    if cfg.rollout.engine == "vllm" and cfg.rollout.temperature > 2:
        raise ConfigError(
            f"rollout.temperature={cfg.rollout.temperature!r}: rollout.engine=vllm samples at temperatures up to 2"
            " only (vLLM refuses higher ones); lower it or use rollout.engine=hf"
        )
    if not cfg.rollout.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.vllm_gpu_memory_utilization={cfg.rollout.vllm_gpu_memory_utilization!r} must be in (0, 1]")
    if cfg.rollout.vllm_kv_cache_gib != int(cfg.rollout.vllm_kv_cache_gib):
        # vLLM's CPU build reads VLLM_CPU_KVCACHE_SPACE with int(): 0.25 would stop the engine at its start
        raise ConfigError(f"rollout.vllm_kv_cache_gib={cfg.rollout.vllm_kv_cache_gib!r} must be a whole number of GiB (vLLM's CPU build takes no fractions)")
    if not cfg.algorithm.rollout_correction_cap >= 1:
        raise ConfigError(
            f"algorithm.rollout_correction_cap={cfg.algorithm.rollout_correction_cap!r} must be >= 1 (the largest"
            " importance weight a token's loss gets; below 1 every token would be scaled down)"
        )
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p!r} must be in (0, 1]")
    if cfg.rollout.num_thoughts < 2:
        raise ConfigError(
            f"rollout.num_thoughts={cfg.rollout.num_thoughts} must be >= 2: advantages are normalised over the"
            " thoughts of a prompt, so a single thought always gets advantage 0"
        )
    if cfg.algorithm.answer_baseline == "thought" and cfg.rollout.num_answers < 2:
        raise ConfigError(
            "algorithm.answer_baseline='thought' needs rollout.num_answers >= 2 (with one answer per thought"
            " every answer advantage would be 0); for plain GRPO (M = 1) set algorithm.advantage_estimator=grpo and"
            " algorithm.answer_baseline=prompt, as configs/tiny-grounding-t16a1.yaml does"
        )
    if cfg.algorithm.advantage_estimator == "grpo" and cfg.algorithm.answer_baseline != "prompt":
        raise ConfigError(
            f"algorithm.advantage_estimator=grpo normalises every answer over its prompt's K*M answers; set"
            f" algorithm.answer_baseline=prompt (it is {cfg.algorithm.answer_baseline!r})"
        )
    for kind in ("thought", "answer"):
        buffer, limit = _get(cfg, f"algorithm.overlong_buffer_{kind}_tokens"), _get(cfg, f"rollout.max_{kind}_tokens")
        if buffer > limit:
            raise ConfigError(
                f"algorithm.overlong_buffer_{kind}_tokens={buffer} must be <= rollout.max_{kind}_tokens={limit}"
                " (the penalty ramps over the last that many tokens before the limit)"
            )
    if cfg.data.tasks:
        bad = {name: w for name, w in cfg.data.tasks.items() if not w > 0}
        if bad:
            raise ConfigError(f"data.tasks weights must be > 0, got {bad}")
        if cfg.data.source is not None:
            raise ConfigError("data.source is for a single data.task; with data.tasks name files in data.sources")
    unknown_sources = sorted(set(cfg.data.sources) - set(cfg.data.tasks))
    if unknown_sources:
        raise ConfigError(f"data.sources names {unknown_sources}, which are not in data.tasks {sorted(cfg.data.tasks)}")
    unknown_eval = sorted(set(cfg.data.eval_sources) - set(cfg.task_weights))
    if unknown_eval:
        raise ConfigError(f"data.eval_sources names {unknown_eval}, which are not tasks of this run {sorted(cfg.task_weights)}")
    for name, weight in cfg.data.reward_weights.items():
        if not isinstance(weight, (int, float)):
            raise ConfigError(f"data.reward_weights.{name}={weight!r} must be a number")
    if cfg.train.output_dir is not None and not cfg.train.output_dir.strip():
        raise ConfigError(
            f"train.output_dir={cfg.train.output_dir!r} is empty: name a folder, or leave it unset for {default_output_dir(cfg)}"
        )
    if cfg.train.output_dir is None:
        cfg.train.output_dir = default_output_dir(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Merging YAML and overrides into the typed tree


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Coerce ``value`` to the field's annotated type or raise ConfigError naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(key, value, arg)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0])
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        return [_check_type(key, v, typing.get_args(annotation)[0]) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        return {str(k): _check_type(f"{key}.{k}", v, typing.get_args(annotation)[1]) for k, v in value.items()}
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r} must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} must be a string")
    return value


def _apply(section_obj: Any, section_name: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(section_obj))
    names = [f.name for f in dataclasses.fields(section_obj)]
    for key, value in values.items():
        if key not in names:
            if f"{section_name}.{key}" in REPLACED_KEYS:
                raise ConfigError(f"{section_name}.{key} is gone: {REPLACED_KEYS[f'{section_name}.{key}']}")
            raise ConfigError(f"unknown config key {section_name}.{key}; valid keys: {', '.join(names)}")
        if isinstance(value, bool) and "no" in CHOICES.get(f"{section_name}.{key}", ()):
            value = "yes" if value else "no"  # YAML 1.1 reads a bare `no` (e.g. mixed_precision: no) as false
        setattr(section_obj, key, _check_type(f"{section_name}.{key}", value, hints[key]))


def merge(cfg: Config, values: dict[str, Any]) -> Config:
    sections = [f.name for f in dataclasses.fields(cfg)]
    for section, section_values in (values or {}).items():
        if section not in sections:
            raise ConfigError(f"unknown config section {section!r}; valid sections: {', '.join(sections)}")
        if not isinstance(section_values, dict):
            raise ConfigError(f"config section {section!r} must be a mapping, got {section_values!r}")
        _apply(getattr(cfg, section), section, section_values)
    return cfg
