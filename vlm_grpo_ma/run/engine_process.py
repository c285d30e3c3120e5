"""An engine process of a split launch (``rollout.engine_processes``; the schedule is ``split_launch.py``'s): it
holds a copy of the policy that only samples, draws the step's prompts from the same seeded stream as the
trainers, samples its share of each step's trees and sends each trainer its part, taking new weights between
steps only. It writes nothing to the run folder: the trainers log, checkpoint and resume, and tell it where to
start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections import Counter

import torch

from vlm_grpo_ma.engines.rollout import gather_groups
from vlm_grpo_ma.run import survive
from vlm_grpo_ma.run.bridge import EXCHANGE, START, TREE, WEIGHTS_HEADER, Bridge, PeerLost
from vlm_grpo_ma.run.config import Config, ConfigError
from vlm_grpo_ma.run.split_launch import Placement, engine_slots, trainer_slots

log = logging.getLogger("vlm_grpo_ma.engine")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class WeightsInbox:
    """The weight versions trainer 0 sends, loaded into the engine's policy in order; ``take(at_least)`` loads
    those already sent (announced on the launch's store) and waits only while the newest is below ``at_least``."""

    def __init__(self, bridge: Bridge, policy, engine):
        self.bridge, self.policy, self.engine = bridge, policy, engine
        self.version = -1  # none loaded yet

    def take(self, at_least: int) -> float:
        """Load every version sent so far, and wait for more while the newest is below ``at_least``; returns the
        seconds spent waiting for versions not yet sent."""
        sent, waited = self.bridge.announced(), 0.0
        while self.version < max(at_least, sent, 0):
            started = time.perf_counter()
            header = self.bridge.recv_object(0, WEIGHTS_HEADER)
            if header["version"] > sent:  # not sent when this began: the engine waited for the trainers
                waited += time.perf_counter() - started
            self.load(header)
        return waited

    def load(self, header: dict) -> None:
        state = self.policy.model.state_dict()
        unknown = sorted(set(header["names"]) - set(state))
        missing = sorted(set(state) - set(header["names"]))
        if unknown or missing:
            raise RuntimeError(f"the trainers' weights do not fit the engine's model: unknown {unknown[:3]}, missing {missing[:3]}")
        with torch.no_grad():
            for name, tensor in self.bridge.recv_weights(0, header, getattr(torch, header["dtype"])):
                state[name].copy_(tensor)
        self.engine.push_weights(self.policy)  # vLLM: into its own memory; the HF engine samples with this policy
        self.version = header["version"]


def run_engine_process(cfg: Config, placement: Placement, bridge: Bridge) -> int:
    """``serve_rollouts`` with the exit code of the command: an engine says its own failure in one line; a
    trainer's end (its connection closing) is said by the trainer."""
    restore_sigterm = survive.raise_on_sigterm()  # the launcher's SIGTERM ends the engine with 143, quietly
    try:
        serve_rollouts(cfg, placement, bridge)
    except PeerLost as error:
        log.error("%s: stopping, %s", placement.describe(placement.rank), error)
        return 1
    except ConfigError as error:
        print(f"error: {placement.describe(placement.rank)}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # Ctrl-C or the launcher's SIGTERM: the trainers save; an engine holds nothing to save
        return interrupt.exit_code if isinstance(interrupt, survive.Terminated) else 130
    finally:
        restore_sigterm()
    return 0


def serve_rollouts(cfg: Config, placement: Placement, bridge: Bridge) -> None:
    from accelerate.utils import set_seed

    from vlm_grpo_ma.run.loop import draw_prompts, encode_sample, sampling_settings
    from vlm_grpo_ma.run.rollout_engine import make_engine, media_room
    from vlm_grpo_ma.run.setup import load_model_policy, load_prompt_stream

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    set_seed(cfg.train.seed)
    index, prompts_per_step = placement.rank - placement.trainers, cfg.train.prompts_per_step
    # The policy's copy samples (HF engine) on the GPU; beside a vLLM engine it only receives the weights and
    # encodes prompts, in host memory, leaving the GPU to vLLM.
    on_gpu = torch.cuda.is_available() and cfg.rollout.engine == "hf"
    device = torch.device("cuda:0") if on_gpu else torch.device("cpu")  # its own GPU (split_launch.pin_gpu)
    tasks, stream = load_prompt_stream(cfg)
    policy = load_model_policy(cfg, cfg.model.name_or_path, device)
    policy.model.eval().requires_grad_(False)
    start = bridge.recv_object(0, START)
    stream.load_state_dict(start["data"])
    max_images, max_videos, tool_images = media_room(cfg, tasks, stream.samples)
    engine = make_engine(cfg, policy, max_images=max_images + tool_images, max_videos=max_videos)
    inbox = WeightsInbox(bridge, policy, engine)
    mine = engine_slots(placement, prompts_per_step)[index]
    others = [rank for rank in placement.engine_ranks if rank != placement.rank]
    autocast = AUTOCAST.get(cfg.train.mixed_precision)
    try:
        for step in range(start["start_step"], cfg.train.steps):
            idle = inbox.take(at_least=step - cfg.rollout.max_staleness)  # between steps only: one version a tree
            samples, prompts = draw_prompts(
                stream, prompts_per_step, lambda sample: encode_sample(policy, sample), Counter(),
                process_index=index, num_processes=placement.engines, exchange=engines_exchange(bridge, others),
            )  # fmt: skip
            settings = sampling_settings(cfg, step, mine.start, len(mine))
            sampling = torch.autocast(device.type, dtype=autocast) if autocast and engine.samples_with_policy else contextlib.nullcontext()
            started = time.perf_counter()
            with sampling, torch.no_grad():
                rollout = engine.sample(policy, samples[mine.start : mine.stop], prompts[mine.start : mine.stop],
                                        num_thoughts=cfg.rollout.num_thoughts, num_answers=cfg.rollout.num_answers, settings=settings)  # fmt: skip
            tree = rollout.tree
            speed = (sum(map(len, tree.thought_ids)) + sum(map(len, tree.answer_ids))) / (time.perf_counter() - started)
            rollout = dataclasses.replace(rollout, prompts=[None] * rollout.num_prompts)  # each trainer encodes its own
            report = {"step": step, "version": inbox.version, "engine_idle_s": idle, "tokens_per_second": speed,
                      "engine_metrics": engine.step_metrics()}  # fmt: skip
            for trainer in range(placement.trainers):
                overlap = [b - mine.start for b in trainer_slots(placement, prompts_per_step, trainer) if b in mine]
                if overlap:
                    piece = gather_groups([(rollout, b) for b in overlap])
                    bridge.send_object({**report, "rollout": piece}, trainer, TREE)
        inbox.take(at_least=cfg.train.steps - 1)  # the versions sent after this engine's last step
        bridge.goodbye(list(range(placement.trainers)))
        bridge.flush()
    finally:
        engine.close(orderly=True)


def engines_exchange(bridge: Bridge, others: list[int]):
    """``exchange`` for ``draw_prompts`` among the engine processes (every engine's result, in launch order)."""

    def exchange(work):
        result = work()
        for rank in others:
            bridge.send_object(result, rank, EXCHANGE)
        results = {bridge.rank: result} | {rank: bridge.recv_object(rank, EXCHANGE) for rank in others}
        return [results[rank] for rank in sorted(results)]

    return exchange
