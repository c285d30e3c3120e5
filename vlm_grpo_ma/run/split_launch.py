"""A launch split into trainer and engine processes (``rollout.engine_processes=N``, ``rollout.max_staleness=S``).

The last N processes of the launch only sample; the others only train, DDP or FSDP2 among themselves, exactly
as a launch of that many processes would (``split_launch`` gives each side an environment of its own before
anything starts a process group, so the trainers' Accelerator sees the trainers alone). The two sides talk over
a bridge of their own (``bridge.py``): trees from the engines, weights from trainer 0.

The schedule, with versions counted in updates (the weights after step s's update are version s + 1):
- an engine samples step s with the newest weights it has received, waiting only while it holds fewer than
  version s - S; it takes newer weights between steps only, so each step's trees (each prompt's whole K x M tree)
  come from one version, recorded with them;
- a trainer, at step s, receives step s's trees (its share), trains, and sends version s + 1 (none after the last
  step). Staleness is then s - version, at most S; a tree older than S is dropped and counted.
At S = 0 an engine waits for each update, and the launch computes what one process computes: a prompt's tree is
a function of (seed, step, prompt) wherever it is sampled, and the engine holds the trainer's weights exactly.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

from vlm_grpo_ma.run.bridge import START, TREE, Bridge, PeerLost
from vlm_grpo_ma.run.config import Config, ConfigError

log = logging.getLogger("vlm_grpo_ma.train")
BRIDGE_START = datetime.timedelta(minutes=10)  # how long the processes of a launch wait for each other at start


@dataclass(frozen=True)
class Placement:
    """Where this process stands in a split launch: launch rank ``rank`` of ``size``, the last ``engines`` of
    which sample."""

    rank: int
    size: int
    engines: int

    @property
    def trainers(self) -> int:
        return self.size - self.engines

    @property
    def is_engine(self) -> bool:
        return self.rank >= self.trainers

    @property
    def engine_ranks(self) -> list[int]:
        return list(range(self.trainers, self.size))

    def describe(self, rank: int) -> str:
        """What launch rank ``rank`` is, in an error's words."""
        if rank >= self.trainers:
            return f"engine process {rank - self.trainers} (launch rank {rank})"
        return f"trainer process {rank} (launch rank {rank})"


def check_split(cfg: Config, launch_size: int) -> None:
    """ConfigError for a split the run cannot make: no trainer left, shares that are not whole groups, or what the
    split does not run yet (dynamic sampling's extra draws, a tensor-parallel engine)."""
    n, prompts = cfg.rollout.engine_processes, cfg.train.prompts_per_step
    if n >= launch_size:
        how = "run it under accelerate launch or torchrun with more processes" if launch_size == 1 else "launch more processes or set fewer"
        raise ConfigError(
            f"rollout.engine_processes={n} leaves no trainer in a launch of {launch_size} process(es): the last"
            f" {n} processes sample and the others train; {how}"
        )
    trainers = launch_size - n
    for count, what in ((n, "engine"), (trainers, "trainer")):
        if prompts % count:
            raise ConfigError(
                f"train.prompts_per_step={prompts} must be a multiple of the {count} {what} processes"
                f" (rollout.engine_processes={n} of {launch_size}): each takes an equal share of whole K x M trees"
            )
    if cfg.algorithm.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling draws a step again after scoring it: not with rollout.engine_processes > 0 yet; set one of them off")
    if cfg.rollout.vllm_tensor_parallel_size > 1:
        raise ConfigError("rollout.vllm_tensor_parallel_size > 1 with rollout.engine_processes > 0: each engine process holds one whole engine; set it to 1")


def split_launch(cfg: Config) -> tuple[Placement, Bridge]:
    """This process's place in the launch and the bridge to the other side; called before any process group
    exists. Rewrites the launcher's environment so that the trainers see a launch of trainers only (RANK,
    WORLD_SIZE) and an engine a process of its own."""
    import torch.distributed as dist

    rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    check_split(cfg, size)
    placement = Placement(rank=rank, size=size, engines=cfg.rollout.engine_processes)
    address, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's (and accelerate launch's) own store
        store = dist.TCPStore(address, port, is_master=False, timeout=BRIDGE_START)
        store = dist.PrefixStore(f"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    else:  # launched by hand: the first process keeps a store beside the trainers' own
        store = dist.TCPStore(address, port + 1, size, is_master=rank == 0, timeout=BRIDGE_START)
    bridge = Bridge.open(store, rank, size, placement.describe)
    if placement.is_engine:
        os.environ.update(RANK="0", WORLD_SIZE="1")
        for key in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        pin_gpu(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        os.environ["WORLD_SIZE"] = str(placement.trainers)
        bridge.watch(placement.engine_ranks)  # which engine stopped, when the launcher stops the trainers
    return placement, bridge


def pin_gpu(local_rank: int) -> None:
    """An engine process sees only its own GPU, the ``local_rank``-th of this machine's (several processes share
    one where there are fewer GPUs), so that its model and a vLLM engine, which takes device 0 of what it sees, land
    there. Before anything starts CUDA; nothing on a machine without GPUs."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(index) for index in range(count)]
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]


def stopped_engines(split) -> str | None:
    """The line a trainer of a split launch says when the launch stops it (SIGTERM): which engine processes had
    stopped without finishing, if any did. ``split``: (placement, bridge), or None outside a split launch."""
    if split is None:
        return None
    placement, bridge = split
    gone = [placement.describe(rank) for rank in bridge.stopped()]
    return f"error: {', '.join(gone)} stopped mid-run, so the launch stopped" if gone else None


def engine_slots(placement: Placement, prompts: int) -> list[range]:
    """The prompts of a step each engine samples, in engine order."""
    share = prompts // placement.engines
    return [range(e * share, (e + 1) * share) for e in range(placement.engines)]


def trainer_slots(placement: Placement, prompts: int, trainer: int) -> range:
    share = prompts // placement.trainers
    return range(trainer * share, (trainer + 1) * share)


class RemoteEngine:
    """The trainers' engine in a split launch (the engine protocol of ``vlm_grpo_ma/engines``): ``sample`` receives
    this trainer's share of the step's trees from the engine processes; ``push_weights`` sends the update's weights
    (trainer 0; every trainer walks the stream, FSDP's gathers being collective)."""

    name = "remote"
    samples_with_policy = False
    processes_per_engine = 1
    metrics_prefix = None

    def __init__(self, cfg: Config, placement: Placement, bridge: Bridge, *, start_step: int, stream_state: dict, policy):
        self.cfg, self.placement, self.bridge = cfg, placement, bridge
        self.step = self.version = start_step  # the step to receive next; the weights' version (updates done)
        self.dtype = next(policy.model.parameters()).dtype
        self.last: dict[str, float] = {}
        if placement.rank == 0:
            for rank in placement.engine_ranks:
                bridge.send_object({"start_step": start_step, "data": stream_state}, rank, START)
        self._send_weights(policy)  # the engines start from the trainers' weights (a resume's, LoRA merged)

    def sample(self, policy, samples, prompts, *, num_thoughts: int, num_answers: int, settings):
        from vlm_grpo_ma.engines.rollout import gather_groups

        waited = time.perf_counter()
        mine = trainer_slots(self.placement, self.cfg.train.prompts_per_step, self.placement.rank)
        groups, versions, engine_idle, speeds, engine_metrics = [], [], 0.0, [], {}
        for rank, slots in zip(self.placement.engine_ranks, engine_slots(self.placement, self.cfg.train.prompts_per_step), strict=True):
            if not set(slots) & set(mine):
                continue
            tree = self.bridge.recv_object(rank, TREE)
            if tree["step"] != self.step:
                raise RuntimeError(f"{self.placement.describe(rank)} sent step {tree['step']}'s trees where step {self.step}'s were due")
            engine_idle, speeds = max(engine_idle, tree["engine_idle_s"]), speeds + [tree["tokens_per_second"]]
            engine_metrics.update(tree["engine_metrics"])  # vLLM's prefix-cache hit rate
            piece = tree["rollout"]
            groups += [(piece, b) for b in range(piece.num_prompts)]
            versions += [tree["version"]] * piece.num_prompts
        trainer_idle = time.perf_counter() - waited
        rollout = gather_groups(groups)
        sampled, drawn = [sample.id for sample in rollout.samples], [sample.id for sample in samples]
        if sampled != drawn:  # both sides walk the same seeded stream and skip the same broken images
            raise RuntimeError(f"the engines sampled prompts {sampled} where this trainer drew {drawn}: the two sides' data differ")
        rollout.samples, rollout.prompts = list(samples), list(prompts)
        rollout, staleness, dropped = fresh_trees(rollout, versions, self.step, self.cfg.rollout.max_staleness)
        rollout.staleness = staleness
        self.last = {
            **engine_metrics,
            "rollout/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "rollout/staleness_max": max(staleness, default=0),
            "rollout/stale_trees_dropped": dropped,
            "time/trainer_idle_s": trainer_idle,
            "time/engine_idle_s": engine_idle,
            # the engines' own sampling speed (the step's wait for its trees is time/rollout_seconds)
            "time/generated_tokens_per_second": sum(speeds) / len(speeds),
        }
        self.step += 1
        return rollout

    def push_weights(self, policy) -> None:
        self.version += 1
        self.last_push = {}
        if self.version < self.cfg.train.steps:  # after the last step no tree is sampled again
            self._send_weights(policy)

    def _send_weights(self, policy) -> None:
        from vlm_grpo_ma.engines.vllm import streamed_weights

        started = time.perf_counter()
        to = self.placement.engine_ranks if self.placement.rank == 0 else []
        header = {"version": self.version, "dtype": str(self.dtype).removeprefix("torch.")}
        sent = self.bridge.send_weights(streamed_weights(policy, self.dtype), to, header)
        if to:
            self.bridge.announce(self.version)
        self.last_push = {"time/weights_push_s": time.perf_counter() - started, "rollout/weights_push_bytes": sent}

    def sleep_until_push(self) -> None:
        """Nothing: the engines hold their memory in their own processes."""

    def step_metrics(self) -> dict[str, float]:
        return {**self.last, **self.last_push}

    def close(self, orderly: bool) -> None:
        """Wait until the engines have what was sent, unless one has stopped (nothing would receive it)."""
        if orderly:
            try:
                self.bridge.flush()
            except PeerLost:
                pass


def in_flight_at_resume(cfg: Config, start_step: int) -> int:
    """The trees a resumed split run discards: those the engines had sampled ahead of the checkpoint, up to
    ``max_staleness`` steps of prompts (none past the last step)."""
    return min(cfg.rollout.max_staleness, cfg.train.steps - start_step) * cfg.train.prompts_per_step


def fresh_trees(rollout, versions: list[int], step: int, max_staleness: int):
    """``rollout`` without the prompts whose trees are more than ``max_staleness`` updates older than ``step``
    (``versions``: each prompt's weights version), the staleness of those kept, and how many were dropped."""
    from vlm_grpo_ma.engines.rollout import gather_groups

    staleness = [step - version for version in versions]
    keep = [b for b, age in enumerate(staleness) if age <= max_staleness]
    if len(keep) == len(versions):
        return rollout, staleness, 0
    if not keep:
        raise RuntimeError(f"every tree of step {step} is older than rollout.max_staleness={max_staleness}")
    return gather_groups([(rollout, b) for b in keep]), [staleness[b] for b in keep], len(versions) - len(keep)
