"""K thoughts x M answers per prompt -> a Rollout with explicit (prompt, thought, answer) indices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from vlm_grpo_ma.engines.decode import SamplingSettings, TreeSample, sample_tree
from vlm_grpo_ma.engines.tool_server import ToolServer
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import EncodedPrompt
from vlm_grpo_ma.task_api.registry import Completion, Sample


@dataclass
class Rollout:
    """The sampling tree of one step. Answer row ``a = (b * K + k) * M + m``; thought row ``t = b * K + k``."""

    samples: list[Sample]  # [B]
    prompts: list[EncodedPrompt]  # [B]
    num_thoughts: int  # K
    num_answers: int  # M
    tree: TreeSample
    completions: list[Completion]  # [B * K * M], answer-row order
    # [B] per prompt: the updates its tree's weights were behind the trainer's when it trained (a split launch's
    # engines sample ahead: run/split_launch.py); None: sampled with the trained weights themselves
    staleness: list[int] | None = None

    @property
    def num_prompts(self) -> int:
        return len(self.samples)

    def thought_row(self, b: int, k: int) -> int:
        return b * self.num_thoughts + k

    def answer_row(self, b: int, k: int, m: int) -> int:
        return self.thought_row(b, k) * self.num_answers + m

    def answers_void(self, thought_row: int, truncated_thoughts: str) -> bool:
        """Whether the answers after thought ``thought_row`` are scored 0 by rule rather than by their task,
        and so are not trained on: the thought ended the model's turn (its answers continue past the end of
        the turn), it called a tool past ``rollout.max_turns`` (over-turn: it and its answers are left out of the
        loss, as Mini-o3 masks them), or it was truncated and ``truncated_thoughts == "zero"`` (the 0 is the thought's penalty for
        running out of tokens; it says nothing about the answers, so their tokens get no gradient from it).
        The thought's own tokens still are trained: their advantage carries the penalty."""
        tree = self.tree
        return (
            tree.thought_ended_turn[thought_row]
            or tree.thought_over_turns[thought_row]
            or (truncated_thoughts == "zero" and tree.thought_truncated[thought_row])
        )

    def indices(self, answer_row: int) -> tuple[int, int, int]:
        """(prompt b, thought k, answer m) of an answer row."""
        thought_row, m = divmod(answer_row, self.num_answers)
        b, k = divmod(thought_row, self.num_thoughts)
        return b, k, m


def gather_groups(groups: Sequence[tuple[Rollout, int]]) -> Rollout:
    """One Rollout of the prompt groups ``(rollout, b)``, in that order, each with its K thoughts and K*M answers
    (dynamic sampling keeps groups from several draws). The rollouts share K and M."""
    first = groups[0][0]
    K, M = first.num_thoughts, first.num_answers
    thought_rows = [(r, r.thought_row(b, k)) for r, b in groups for k in range(K)]
    answer_rows = [(r, r.answer_row(b, k, m)) for r, b in groups for k in range(K) for m in range(M)]
    columns = {}
    for item in fields(TreeSample):  # thought_* fields hold a row per thought, answer_* fields one per answer
        if item.name.startswith(("thought_", "answer_")):
            rows = thought_rows if item.name.startswith("thought_") else answer_rows
            columns[item.name] = [getattr(r.tree, item.name)[i] for r, i in rows]
    encoded = sum({id(r): r.tree.vision_images_encoded for r, _ in groups}.values())
    return Rollout(
        samples=[r.samples[b] for r, b in groups],
        prompts=[r.prompts[b] for r, b in groups],
        num_thoughts=K,
        num_answers=M,
        tree=TreeSample(**columns, vision_images_encoded=encoded),
        completions=[r.completions[i] for r, i in answer_rows],
    )


def generate_rollout(
    policy: Policy,
    samples: Sequence[Sample],
    prompts: Sequence[EncodedPrompt],
    *,
    num_thoughts: int,
    num_answers: int,
    settings: SamplingSettings,
) -> Rollout:
    """The HF engine's rollout: ``decode.sample_tree`` (KV-branching decode loop) as a Rollout; thoughts call their
    tasks' tools through a ``ToolServer``."""
    tools = ToolServer.for_rollout(policy, samples, prompts, num_thoughts, settings.max_turns)
    tree = sample_tree(policy, prompts, num_thoughts=num_thoughts, num_answers=num_answers, settings=settings, tools=tools)
    return rollout_from_tree(policy, samples, prompts, tree, num_thoughts=num_thoughts, num_answers=num_answers)


def rollout_from_tree(
    policy: Policy,
    samples: Sequence[Sample],
    prompts: Sequence[EncodedPrompt],
    tree: TreeSample,
    *,
    num_thoughts: int,
    num_answers: int,
) -> Rollout:
    """A Rollout of a sampled tree, whichever engine sampled it: the token ids decoded into completions."""
    decode = policy.tokenizer.decode
    thought_texts = [decode(readable_thought_ids(ids, turns), skip_special_tokens=False) for ids, turns in zip(tree.thought_ids, tree.thought_turns, strict=True)]
    special = set(policy.eos_token_ids) | {policy.pad_token_id}
    completions = []
    for a, answer_ids in enumerate(tree.answer_ids):
        t = a // num_answers
        b = t // num_thoughts
        completions.append(
            Completion(
                thought=thought_texts[t],
                answer=decode([i for i in answer_ids if i not in special], skip_special_tokens=False),
                frame=policy.frame,
                input_sizes=prompts[b].input_sizes,
                original_sizes=prompts[b].original_sizes,
                thought_truncated=tree.thought_truncated[t],
                answer_truncated=tree.answer_truncated[a],
                tool_calls=len(tree.thought_turns[t]) + int(tree.thought_over_turns[t]),
                invalid_tool_calls=sum(turn.error for turn in tree.thought_turns[t]),
                tool_images=sum(turn.num_images for turn in tree.thought_turns[t]),
                tool_boxes=tuple(box for turn in tree.thought_turns[t] for box in turn.boxes),
            )
        )
    return Rollout(list(samples), list(prompts), num_thoughts, num_answers, tree, completions)


def readable_thought_ids(thought_ids: list[int], turns) -> list[int]:
    """A thought's ids with each tool turn's images collapsed to one placeholder each (its unexpanded form): the
    text rewards, records and tables read, without hundreds of vision placeholders."""
    if not turns:
        return thought_ids
    ids, at = [], 0
    for turn in turns:
        ids += thought_ids[at : turn.start] + turn.unexpanded_ids
        at = turn.start + len(turn.ids)
    return ids + thought_ids[at:]
