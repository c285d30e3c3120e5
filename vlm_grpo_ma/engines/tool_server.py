"""Serving a tree's tool calls: each thought row's call is parsed and run with its prompt's task's tools
(``task_api.tools.run_tool_call``: an error turn, never an exception, for a call that cannot be served) and the
result rendered as the turn the model reads (``model.prompts.encode_tool_turn``). Both engines use it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import EncodedPrompt, ToolTurn, encode_tool_turn
from vlm_grpo_ma.task_api.registry import Sample, task_tools
from vlm_grpo_ma.task_api.tools import TOOL_CALL_CLOSE, ToolContext, ToolResult, call_text, run_tool_call


def tool_context(policy: Policy, sample: Sample, prompt: EncodedPrompt) -> ToolContext:
    """What a tool (and a target that writes calls) may read of a prompt as the model sees it."""
    return ToolContext(tuple(sample.images), prompt.input_sizes, prompt.original_sizes, policy.frame)


class ToolServer:
    """The tools of a tree's prompts. Thought row ``row`` belongs to prompt ``row // num_thoughts``."""

    stop_text = TOOL_CALL_CLOSE

    def __init__(self, policy: Policy, samples: Sequence[Sample], prompts: Sequence[EncodedPrompt], num_thoughts: int):
        self.policy = policy
        self.num_thoughts = num_thoughts
        self.tools = [task_tools(sample.task) for sample in samples]
        self.contexts = [tool_context(policy, sample, prompt) for sample, prompt in zip(samples, prompts, strict=True)]

    @classmethod
    def for_rollout(cls, policy: Policy, samples, prompts, num_thoughts: int, max_turns: int) -> ToolServer | None:
        """A server when some prompt's task declares tools and turns are allowed; None otherwise (the sampler then
        runs exactly as without tools)."""
        if max_turns <= 0 or not any(task_tools(sample.task) for sample in samples):
            return None
        return cls(policy, samples, prompts, num_thoughts)

    def serves(self, row: int) -> bool:
        return bool(self.tools[row // self.num_thoughts])

    def respond(self, row: int, call_ids: list[int]) -> ToolTurn:
        prompt = row // self.num_thoughts
        text = call_text(self.policy.tokenizer.decode(call_ids, skip_special_tokens=False))
        if text is None:  # the stop text without its opening tag
            result = ToolResult(text="Error: a tool call is <tool_call>{...}</tool_call>", error=True)
        else:
            result = run_tool_call(self.tools[prompt], text, self.contexts[prompt])
        return encode_tool_turn(self.policy, result)

    def replay(self, prompt: int, text: str) -> tuple[list[int], list[ToolTurn]]:
        """A written completion (a warm start's target) as the sampler would have fed it: the text split after each
        ``</tool_call>``, each call served and its turn placed between the pieces. Returns (token ids, turns)."""
        ids: list[int] = []
        turns: list[ToolTurn] = []
        pieces = text.split(self.stop_text)
        for index, piece in enumerate(pieces):
            own = self.policy.tokenizer.encode(piece + (self.stop_text if index < len(pieces) - 1 else ""), add_special_tokens=False)
            ids += own
            if index < len(pieces) - 1:
                turn = self.respond(prompt * self.num_thoughts, own)
                turns.append(dataclasses.replace(turn, start=len(ids)))
                ids += turn.ids
        return ids, turns
