"""DAPO's dynamic sampling (arXiv 2503.14476), the same whatever the number of processes.

A prompt group whose K*M rewards are all equal carries no signal. With ``algorithm.dynamic_sampling`` the trainer
draws the step again (``loop.sample_step``) until the draws hold ``train.prompts_per_step`` informative groups or
the extra draws run out; the step then trains the first informative groups in draw order, filled up with the
first uninformative ones. Each process samples and scores its share of each draw; the groups' trees and scores
are exchanged (``draw_groups``), so every process sees every group, makes the same decision and takes its share
of the chosen groups (``keep_groups``): N processes train the groups one process trains.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch

from vlm_grpo_ma.engines.rollout import Rollout, gather_groups
from vlm_grpo_ma.model.prompts import EncodedPrompt
from vlm_grpo_ma.run.rewards import ScoredRollout, gather_scored_groups
from vlm_grpo_ma.task_api.registry import Sample


@dataclass
class Group:
    """Prompt ``b`` of a rollout and its scores; ``informative``: its K*M rewards are not all equal."""

    rollout: Rollout
    scored: ScoredRollout
    b: int
    informative: bool


def choose_groups(informative: list[bool], needed: int) -> list[int]:
    """Indices (in draw order) of the groups a step trains: the first ``needed`` informative ones, then the first
    uninformative ones while fewer than ``needed`` were found."""
    chosen = [i for i, has_signal in enumerate(informative) if has_signal][:needed]
    fill = [i for i, has_signal in enumerate(informative) if not has_signal][: needed - len(chosen)]
    return chosen + fill


def draw_groups(
    accelerator, rollout: Rollout, scored: ScoredRollout, informative: torch.Tensor, samples: list[Sample],
    prompts: list[EncodedPrompt],
) -> list[Group]:  # fmt: skip
    """Every process's groups of one draw, in the draw's order. ``rollout``, ``scored`` and ``informative`` [B_local]
    are this process's share; ``samples`` and ``prompts`` the whole draw (every process draws all of it and
    encodes its own share; the other prompts are None, and a group that moves to this process has its prompt
    encoded by the caller), so only the trees and scores cross between processes."""
    share = rollout.num_prompts
    local = (dataclasses.replace(rollout, samples=[], prompts=[]), scored, informative.tolist())
    if accelerator.num_processes == 1:
        parts = [local]
    else:
        from accelerate.utils import gather_object

        parts = gather_object([local])
    groups = []
    for process, (part, part_scored, flags) in enumerate(parts):
        mine = slice(process * share, (process + 1) * share)
        part = dataclasses.replace(part, samples=samples[mine], prompts=prompts[mine])
        groups += [Group(part, part_scored, b, has_signal) for b, has_signal in enumerate(flags)]
    return groups


def keep_groups(groups: list[Group], needed: int, first: int, share: int, counts: Counter) -> tuple[Rollout, ScoredRollout]:
    """This process's share (``first .. first + share``) of the groups the step trains (``choose_groups``), as one
    rollout and its scores carrying ``counts``; the uninformative groups among them are counted
    (``uninformative_groups_trained``)."""
    chosen = [groups[i] for i in choose_groups([g.informative for g in groups], needed)][first : first + share]
    counts["uninformative_groups_trained"] += sum(not g.informative for g in chosen)
    rollout = gather_groups([(g.rollout, g.b) for g in chosen])
    return rollout, gather_scored_groups([(g.scored, g.b) for g in chosen], counts)
