"""The HF engine's tree sampler, the KV-branching decode loop (``sample_tree``).

The B prompts are prefilled once (each image goes through the vision tower once), the KV cache is repeated K
times and K thoughts are decoded until ``</think>``; then the cache is repeated M times and M answers are
decoded from each thought. Prompt, image and thought are never re-encoded for the answers, and token ids
(never re-tokenised text) pass between the stages.

Position ids are computed here, not by the model. Rows finish at different steps; a finished row keeps
receiving pad tokens whose cache slots are masked out and which get no position, so the next real token of
that row sits at position (last real position + 1), exactly as in a re-encode of the row without padding.
(The model's own decode path derives positions from the cache length, which counts those pad slots: a
shorter thought would then see its answer shifted in RoPE position and get different log-probs.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vlm_grpo_ma.model.cache import _cache_argument, _sampling_cache
from vlm_grpo_ma.model.linear_attention import mark_block
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.logprobs import _policy_logprobs
from vlm_grpo_ma.model.prompts import (
    EncodedPrompt,
    ToolTurn,
    VisionGrids,
    _encode_images,
    _encode_vision,
    _left_pad,
    _right_pad,
    _rope_positions,
    _vision_inputs,
    continued_positions,
)

# Each prompt samples from a torch generator seeded with (train.seed * SEED_STRIDE + step) * SEED_STRIDE +
# prompt (run.loop.sampling_settings, prompt_generators); run.config.max_seed keeps that within 64 bits.
SEED_STRIDE = 1_000_003


@dataclass
class TreeSample:
    """Token ids of a K x M sampling tree. Rows: thoughts are prompt-major (b * K + k), answers
    thought-major (t * M + m). ``*_logprobs`` are the sampling log-probs (at the sampling temperature)."""

    thought_ids: list[list[int]]
    thought_logprobs: list[list[float]]
    thought_forced: list[list[bool]]  # tokens the policy did not sample (the closing tag of a truncated thought)
    thought_truncated: list[bool]  # hit max_thought_tokens: "</think>" was forced
    thought_ended_turn: list[bool]  # the model ended its turn (EOS) inside the thought: no answer is possible
    answer_ids: list[list[int]]
    answer_logprobs: list[list[float]]
    answer_truncated: list[bool]
    vision_images_encoded: int = 0
    # Tool use (tasks with tools): each thought's tool turns (``model.prompts.ToolTurn``; their tokens lie in
    # ``thought_ids`` at ``turn.start``, forced), and whether it called past ``max_turns`` (left out of the loss)
    thought_turns: list[list[ToolTurn]] | None = None
    thought_over_turns: list[bool] | None = None

    def __post_init__(self):
        if self.thought_turns is None:
            self.thought_turns = [[] for _ in self.thought_ids]
        if self.thought_over_turns is None:
            self.thought_over_turns = [False] * len(self.thought_ids)


@dataclass
class _DecodeState:
    cache: object
    attention_mask: torch.Tensor  # [N, L]
    next_position: torch.Tensor  # [N]
    logits: torch.Tensor  # [N, V] next-token logits of each row


@dataclass
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    max_thought_tokens: int = 64
    max_answer_tokens: int = 32
    max_turns: int = 0  # tool calls a thought may make (its task's tools); one more closes it as over-turn
    thought_stop: str = "</think>"
    answer_stop: str = "</answer>"
    # One generator per prompt: prompt p's rows (its K thoughts, then its K*M answers) draw from generators[p]
    # alone, so a prompt's tree does not depend on which prompts share its batch: a run split over several
    # processes samples what a one-process run samples. None: torch's global generator.
    generators: Sequence[torch.Generator] | None = field(default=None, repr=False)


def prompt_generators(seed: int, first_prompt: int, count: int) -> list[torch.Generator]:
    """Generators of prompts ``first_prompt .. first_prompt + count - 1`` of a draw seeded by ``seed``."""
    return [torch.Generator().manual_seed(seed * SEED_STRIDE + first_prompt + p) for p in range(count)]


def _sample_tokens(
    logits: torch.Tensor, settings: SamplingSettings, suppressed: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [N], their log-probs [N] under the policy's distribution).
    ``temperature == 0`` is greedy decoding (evaluation): the most likely token, its log-prob at temperature 1."""
    if settings.temperature == 0:
        logprobs = _policy_logprobs(logits, 1.0, suppressed)
        tokens = logprobs.argmax(-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = _policy_logprobs(logits, settings.temperature, suppressed)  # [N, V]
    probs = logprobs.exp()
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < settings.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    if settings.generators is None:
        tokens = torch.multinomial(probs, 1).squeeze(-1)
    else:
        rows_per_prompt, leftover = divmod(probs.shape[0], len(settings.generators))
        if leftover or not rows_per_prompt:
            raise ValueError(f"{probs.shape[0]} rows cannot be split over {len(settings.generators)} prompt generators")
        # Sampled where the generator lives: on the model's device after sample_tree's _generators_on (the
        # [rows x vocab] probabilities never leave it); a CPU generator still gets them copied to the host.
        tokens = torch.cat(
            [
                torch.multinomial(rows.to(generator.device), 1, generator=generator).squeeze(-1).to(logits.device)
                for rows, generator in zip(probs.split(rows_per_prompt), settings.generators, strict=True)
            ]
        )
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _step(policy: Policy, state: _DecodeState, tokens: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Feed one token per row; ``real`` [N] bool marks rows whose token is a real one (else a masked pad)."""
    device = policy.device
    column = real.long()[:, None].to(device)  # this step's block: one token a row, real or a masked pad
    state.attention_mask = torch.cat([state.attention_mask, column], dim=1)
    mark_block(state.cache, column)  # a finished row's pad leaves its linear states as they are
    positions = state.next_position[None, :, None].expand(3, -1, 1)
    out = policy.model(
        input_ids=tokens[:, None].to(device),
        attention_mask=state.attention_mask,
        position_ids=positions,
        **_cache_argument(policy.model, state.cache),
        use_cache=True,
    )
    state.next_position = state.next_position + real.long().to(device)
    return out.logits[:, -1, :]


class ToolCalls(Protocol):
    """How the sampler serves the tool calls of a tree's thoughts (``engines.tool_server.ToolServer``)."""

    stop_text: str  # the text that ends a call

    def serves(self, row: int) -> bool:
        """Whether thought row ``row``'s task declares tools (only such rows stop at a call)."""

    def respond(self, row: int, call_ids: list[int]) -> ToolTurn:
        """The turn that answers the call ending ``call_ids`` (the row's own tokens since its last turn)."""


def _decode(
    policy: Policy,
    state: _DecodeState,
    *,
    max_tokens: int,
    stop_text: str,
    forced_suffix: list[int] | None,
    settings: SamplingSettings,
    tools: ToolCalls | None = None,
):
    """Decode every row until ``stop_text`` appears in its text, an EOS, or ``max_tokens``.

    With ``forced_suffix`` (token ids), a row that has not stopped when only ``len(forced_suffix)`` tokens
    remain gets those tokens forced (not sampled), so that every row ends with the stop text.

    With ``tools`` (thoughts only), a row whose task has tools and that ends a tool call gets the call's result
    fed as a block of context tokens (``_feed_turns``: rows without one feed masked pads and go on at their next
    token), and decoding goes on. The block counts against ``max_tokens``; a result that does not fit truncates
    the thought, and a call past ``settings.max_turns`` closes it with the forced suffix (an over-turn thought).
    Returns (tokens, log-probs, forced flags: True on every token the policy did not sample, tool-result tokens
    included, truncated, each row's turns, each row's over-turn flag).
    Leaves ``state.logits`` as the next-token logits after each row's last real token.
    """
    n = state.logits.shape[0]
    eos = set(policy.eos_token_ids)
    tokens_out: list[list[int]] = [[] for _ in range(n)]
    logprobs_out: list[list[float]] = [[] for _ in range(n)]
    forced_out: list[list[bool]] = [[] for _ in range(n)]
    turns_out: list[list[ToolTurn]] = [[] for _ in range(n)]
    over_turns = [False] * n
    truncated = [False] * n
    done = [False] * n
    suffix_at: list[int | None] = [None] * n  # the next forced-suffix token of a row being closed
    pad = torch.full((n,), policy.pad_token_id, dtype=torch.long)
    final_logits = state.logits.clone()
    suffix_len = len(forced_suffix) if forced_suffix else 0
    stops = [(stop_text, policy.stop_candidates(stop_text))]
    if tools is not None:
        stops.append((tools.stop_text, policy.stop_candidates(tools.stop_text)))
    for _ in range(max_tokens):
        sampled, sampled_logprobs = _sample_tokens(state.logits, settings, policy.suppressed_token_ids)
        sampled, sampled_logprobs = sampled.cpu(), sampled_logprobs.float().cpu()
        real = torch.tensor([not d for d in done])
        tokens = torch.where(real, sampled, pad)
        # read once as Python lists: indexing a tensor element by element costs microseconds a call
        sampled_tokens, sampled_values = sampled.tolist(), sampled_logprobs.tolist()
        pending: dict[int, ToolTurn] = {}
        for row in range(n):
            if done[row]:
                continue
            if suffix_at[row] is None and forced_suffix is not None and len(tokens_out[row]) >= max_tokens - suffix_len:
                suffix_at[row] = 0
            forcing = suffix_at[row] is not None
            token = forced_suffix[suffix_at[row]] if forcing else sampled_tokens[row]
            tokens[row] = token
            tokens_out[row].append(token)
            logprobs_out[row].append(0.0 if forcing else sampled_values[row])
            forced_out[row].append(forcing)
            if forcing:
                suffix_at[row] += 1
                if suffix_at[row] == suffix_len:
                    done[row] = True
                    truncated[row] = not over_turns[row]
                continue
            if token in eos:
                done[row] = True
                continue
            stop = _stop_reached(policy, tokens_out[row], token, stops)
            if stop == stop_text:
                done[row] = True
            elif stop is not None and tools.serves(row):
                since = turns_out[row][-1].start + len(turns_out[row][-1].ids) if turns_out[row] else 0
                if len(turns_out[row]) >= settings.max_turns:
                    over_turns[row], suffix_at[row] = True, 0  # closed now: "</think>" follows the call
                    continue
                turn = tools.respond(row, tokens_out[row][since:])
                if len(tokens_out[row]) + len(turn.ids) + suffix_len >= max_tokens:
                    suffix_at[row] = 0  # the result does not fit in the thought's budget: truncated
                    continue
                pending[row] = turn
        logits = _step(policy, state, tokens, real)
        finished_now = torch.tensor([d for d in done]) & real
        final_logits[finished_now.to(final_logits.device)] = logits[finished_now.to(logits.device)]
        state.logits = torch.where(real[:, None].to(logits.device), logits, state.logits)
        if pending:
            _feed_turns(policy, state, pending)
            for row, turn in pending.items():
                turns_out[row].append(dataclasses.replace(turn, start=len(tokens_out[row])))
                tokens_out[row].extend(turn.ids)
                logprobs_out[row].extend([0.0] * len(turn.ids))
                forced_out[row].extend([True] * len(turn.ids))
        if all(done):
            break
    for row in range(n):
        if not done[row]:
            truncated[row] = True
    state.logits = torch.where(torch.tensor(done)[:, None].to(final_logits.device), final_logits, state.logits)
    return tokens_out, logprobs_out, forced_out, truncated, turns_out, over_turns


def _stop_reached(policy: Policy, row_tokens: list[int], token: int, stops) -> str | None:
    """The stop text that ``token`` completes at the end of ``row_tokens``, or None (each token is at least one
    character, so the last ``len(text)`` tokens hold the text if it just ended)."""
    for text, candidates in stops:
        if token in candidates and text in policy.tokenizer.decode(row_tokens[-len(text) :]):
            return text
    return None


def _feed_turns(policy: Policy, state: _DecodeState, pending: dict[int, ToolTurn]) -> None:
    """Feed each pending row's tool turn as one right-padded block (the other rows feed masked pads), the turns'
    images through the vision tower in one call; the row's next-token logits become those after its turn."""
    device = policy.device
    n = state.logits.shape[0]
    rows = sorted(pending)
    ids, block_mask = _right_pad([pending[r].ids if r in pending else [] for r in range(n)], policy.pad_token_id)
    ids, block_mask = ids.to(device), block_mask.to(device)
    state.attention_mask = torch.cat([state.attention_mask, block_mask], dim=1)
    mark_block(state.cache, block_mask)
    turns = [pending[r] for r in rows]
    _, _, turn_vision = _encode_vision(policy, [], turns)
    grid = torch.cat([t.image_grid_thw for t in turns])
    positions, state.next_position = continued_positions(policy, ids, block_mask, grid, state.next_position)
    hidden = policy.model.model(
        input_ids=ids, attention_mask=state.attention_mask, position_ids=positions, use_cache=True,
        **_cache_argument(policy.model.model, state.cache), **_vision_inputs(None if turn_vision is None else {"image": turn_vision}),
    ).last_hidden_state  # fmt: skip
    index = torch.tensor(rows, device=device)
    last = block_mask[index].sum(dim=1) - 1
    state.logits[index] = policy.model.lm_head(hidden[index, last]).to(state.logits.dtype)


def decode_answers(policy: Policy, state: _DecodeState, settings: SamplingSettings):
    """Decode one answer per row of ``state`` (stop at ``settings.answer_stop``, EOS or the token limit)."""
    tokens, logprobs, _, truncated, _, _ = _decode(
        policy,
        state,
        max_tokens=settings.max_answer_tokens,
        stop_text=settings.answer_stop,
        forced_suffix=None,
        settings=settings,
    )
    return tokens, logprobs, truncated


def _repeat_rows(state: _DecodeState, repeats: int) -> None:
    state.cache.batch_repeat_interleave(repeats)  # in place
    state.attention_mask = state.attention_mask.repeat_interleave(repeats, dim=0)
    state.next_position = state.next_position.repeat_interleave(repeats, dim=0)
    state.logits = state.logits.repeat_interleave(repeats, dim=0)


def prefill(
    policy: Policy, ids: torch.Tensor, mask: torch.Tensor, grids: VisionGrids, *, capacity: int | None = None, **vision_inputs
) -> _DecodeState:
    """Run left-padded prompts [N, L] through the model once, into a fresh KV cache (preallocated for
    ``capacity`` tokens per row when given). ``grids`` are the rows' image and video grids; ``vision_inputs``
    the model's image and video arguments: ``mm_encoder_outputs`` (features already computed) or
    ``pixel_values`` + ``image_grid_thw``."""
    positions = _rope_positions(policy, ids, mask, grids)
    cache = _sampling_cache(policy, capacity)
    mark_block(cache, mask)
    out = policy.model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        **_cache_argument(policy.model, cache),
        use_cache=True,
        logits_to_keep=1,
        **vision_inputs,
    )
    return _DecodeState(
        cache=out.cache if hasattr(out, "cache") else out.past_key_values,
        attention_mask=mask,
        next_position=positions.amax(dim=(0, 2)) + 1,  # [N]
        logits=out.logits[:, -1, :],
    )


def _generators_on(settings: SamplingSettings, device: torch.device) -> SamplingSettings:
    """``settings`` with its per-prompt generators on ``device``, so that sampling stays on the model's
    device (at Qwen's 151,936-token vocabulary, copying 128 rows of probabilities to the host is 78 MB per
    decoded token). Each device generator is seeded by one draw from its prompt's CPU generator: a prompt's
    tree stays a function of (seed, step, prompt), whichever process samples it. On the CPU: unchanged."""
    if settings.generators is None or device.type == "cpu":
        return settings
    seeds = [int(torch.randint(2**62, (), generator=g)) if g.device.type == "cpu" else None for g in settings.generators]
    moved = [g if seed is None else torch.Generator(device=device).manual_seed(seed) for g, seed in zip(settings.generators, seeds, strict=True)]
    return dataclasses.replace(settings, generators=moved)


@torch.no_grad()
def sample_tree(
    policy: Policy,
    prompts: Sequence[EncodedPrompt],
    *,
    num_thoughts: int,
    num_answers: int,
    settings: SamplingSettings,
    tools: ToolCalls | None = None,
) -> TreeSample:
    """K thoughts per prompt, then M answers per thought from the thought's KV cache. With ``tools``, thoughts
    may call their task's tools; the M answers branch after the thought's last turn."""
    device = policy.device
    settings = _generators_on(settings, device)
    ids, mask = _left_pad([p.input_ids for p in prompts], policy.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    vision, grids = _encode_images(policy, prompts)
    # every row's longest possible sequence: prompt, thought, answer (the cache never grows by concatenation)
    capacity = ids.shape[1] + settings.max_thought_tokens + settings.max_answer_tokens
    state = prefill(policy, ids, mask, grids, capacity=capacity, **_vision_inputs(vision))
    _repeat_rows(state, num_thoughts)
    close_ids = policy.tokenizer.encode(settings.thought_stop, add_special_tokens=False)
    thought_ids, thought_logprobs, thought_forced, thought_truncated, thought_turns, thought_over_turns = _decode(
        policy,
        state,
        max_tokens=settings.max_thought_tokens,
        stop_text=settings.thought_stop,
        forced_suffix=close_ids,
        settings=settings,
        tools=tools,
    )
    _repeat_rows(state, num_answers)
    answer_ids, answer_logprobs, answer_truncated = decode_answers(policy, state, settings)
    return TreeSample(
        thought_ids=thought_ids,
        thought_logprobs=thought_logprobs,
        thought_forced=thought_forced,
        thought_truncated=thought_truncated,
        thought_ended_turn=[bool(ids) and ids[-1] in policy.eos_token_ids for ids in thought_ids],
        answer_ids=answer_ids,
        answer_logprobs=answer_logprobs,
        answer_truncated=answer_truncated,
        vision_images_encoded=grids.count + sum(t.num_images for turns in thought_turns for t in turns),
        thought_turns=thought_turns,
        thought_over_turns=thought_over_turns,
    )
