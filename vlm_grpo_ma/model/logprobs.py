"""Token log-probs: the policy's distribution (``_policy_logprobs``, which sampling uses too) and the log-probs
of given completions, the training forward. ``CompletionScorer`` is the one module every trained, old and
reference log-prob goes through: ``shared_prefix_logprobs`` scores rows the way the rollout sampled them (each
prompt and thought once, answers on the thought's KV cache), ``sequence_logprobs`` re-encodes every row (for
gradient checkpointing, which drops the cache, and the warm start)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlm_grpo_ma.model.cache import _cache_argument, new_cache
from vlm_grpo_ma.model.linear_attention import mark_block
from vlm_grpo_ma.model.loading import Policy
from vlm_grpo_ma.model.prompts import (
    EncodedPrompt,
    ToolTurn,
    VisionGrids,
    _encode_vision,
    _joined_items,
    _no_grid,
    _right_pad,
    _rope_positions,
    _select_vision_rows,
    _vision_inputs,
    _vision_items,
    _zero_of,
    continued_positions,
    idle_vision_term,
)


def _policy_logprobs(logits: torch.Tensor, temperature: float, suppressed: list[int]) -> torch.Tensor:
    """The policy's distribution: log softmax(logits / temperature) with the suppressed tokens removed.
    Used both for sampling and for training, so the two never disagree."""
    scaled = logits.float() / temperature
    if suppressed:
        scaled[..., suppressed] = float("-inf")
    return torch.log_softmax(scaled, dim=-1)


class CompletionScorer(torch.nn.Module):
    """Log-probs of training rows as one module call: data-parallel wrappers (DDP through
    ``accelerator.prepare``, FSDP2's root unit) see the whole forward, vision tower included, and synchronise
    its gradients."""

    def __init__(self, policy: Policy, *, share_prefixes: bool):
        super().__init__()
        self.model = policy.model  # registers the parameters; the policy object itself is not a module
        self._policy = policy
        self.share_prefixes = share_prefixes

    def forward(self, prompts, row_prompt, completions, thought_lengths, *, temperature: float, thought_turns=None) -> torch.Tensor:
        """Log-probs [N, T] of training rows (a thought + answer after prompt ``row_prompt[r]``; the thought's tool
        turns ``thought_turns[r]``, their images included): through the KV cache, each prompt and thought encoded
        once (``shared_prefix_logprobs``), or with ``share_prefixes`` off (gradient checkpointing drops the cache)
        by re-encoding every row (``sequence_logprobs``). The two agree."""
        if self.share_prefixes:
            return shared_prefix_logprobs(
                self._policy, prompts, row_prompt, completions, thought_lengths, temperature=temperature, thought_turns=thought_turns
            )
        return sequence_logprobs(self._policy, prompts, row_prompt, completions, temperature=temperature, thought_turns=thought_turns)


def sequence_logprobs(
    policy: Policy,
    prompts: Sequence[EncodedPrompt],
    row_prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    thought_turns: Sequence[Sequence[ToolTurn]] | None = None,
) -> torch.Tensor:
    """Log-probs of each row's completion tokens given its prompt: rows are prompt ``row_prompt[r]`` followed
    by ``completions[r]``, whose tool turns (``thought_turns[r]``) carry the images after the prompt's. Images
    are encoded once per prompt and shared by the rows (gradients flow back to the vision tower). Returns [N, T]
    (T = longest completion; padding positions hold 0).
    """
    device = policy.device
    width_prompt = [len(prompts[p].input_ids) for p in row_prompt]
    lengths = [len(c) for c in completions]
    n = len(completions)
    # right padding: every row starts at position 0
    ids, mask = _right_pad([prompts[p].input_ids + list(c) for p, c in zip(row_prompt, completions, strict=True)], policy.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    used = sorted(set(row_prompt))
    turns_of_row = [list(turns) for turns in thought_turns] if thought_turns is not None else [[] for _ in row_prompt]
    all_turns = [turn for turns in turns_of_row for turn in turns]
    vision, _, turn_vision = _encode_vision(policy, [prompts[p] for p in used], all_turns)
    # no image in this micro-batch: the tower runs anyway, where it would have run (see idle_vision_term)
    idle_vision = idle_vision_term(policy) if vision is None and turn_vision is None else None
    row_vision = _select_vision_rows(vision, [prompts[p] for p in used], [used.index(p) for p in row_prompt])
    grids = VisionGrids.of([prompts[p] for p in row_prompt]).to(device)
    if turn_vision is not None:  # each row's images: its prompt's, then its turns', as its tokens hold them
        row_vision, grids = _with_turn_images(vision, turn_vision, [prompts[p] for p in used], row_prompt, used, turns_of_row, row_vision, grids)
    positions = _rope_positions(policy, ids, mask, grids)
    hidden = policy.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, **_vision_inputs(row_vision)
    ).last_hidden_state  # [N, L, H]
    longest = max(lengths) if lengths else 0
    # Hidden states that predict completion token j of row r sit at position width_prompt[r] - 1 + j.
    gather_at = torch.zeros((n, longest), dtype=torch.long)
    valid = torch.zeros((n, longest), dtype=torch.bool)
    for r in range(n):
        gather_at[r, : lengths[r]] = torch.arange(lengths[r]) + width_prompt[r] - 1
        valid[r, : lengths[r]] = True
    gather_at, valid = gather_at.to(device), valid.to(device)
    picked = hidden.gather(1, gather_at[..., None].expand(-1, -1, hidden.shape[-1]))  # [N, T, H]
    targets, _ = _right_pad(completions, 0)
    # the head runs at completion positions only: no [N, L, V] logits
    logprobs = _token_logprobs(policy, picked, targets, temperature)
    if idle_vision is not None:
        logprobs = logprobs + idle_vision
    return _without_context(logprobs.masked_fill(~valid, 0.0), thought_turns)


def _without_context(logprobs: torch.Tensor, thought_turns) -> torch.Tensor:
    """``logprobs`` [N, T] with the tool turns' tokens at 0, as padding: they are context the model did not
    write (weight 0 in the loss), and some of them, such as the image placeholders, are tokens the policy may
    never sample, whose -inf would make NaN of the loss's ratios even at weight 0."""
    if thought_turns is None or not any(thought_turns):
        return logprobs
    context = torch.zeros(logprobs.shape, dtype=torch.bool)
    for r, turns in enumerate(thought_turns):
        for turn in turns:
            context[r, turn.start : turn.start + len(turn.ids)] = True
    return logprobs.masked_fill(context.to(logprobs.device), 0.0)


def _with_turn_images(vision, turn_vision, used_prompts, row_prompt, used, turns_of_row, row_vision, grids):
    """(The rows' vision inputs, their grids) with each row's tool-turn images after its prompt's images."""
    joined = _joined_items(vision["image"] if vision is not None and "image" in vision else None, turn_vision)
    counts = [p.image_grid_thw.shape[0] for p in used_prompts]
    first = [sum(counts[:i]) for i in range(len(counts))]
    order, next_turn_image = [], sum(counts)
    for r, p in enumerate(row_prompt):
        u = used.index(p)
        order += range(first[u], first[u] + counts[u])
        row_turn_images = sum(turn.num_images for turn in turns_of_row[r])
        order += range(next_turn_image, next_turn_image + row_turn_images)
        next_turn_image += row_turn_images
    row_vision = dict(row_vision or {})
    row_vision["image"] = _vision_items(joined, order)
    image_grid = torch.cat(
        [_no_grid(), *(torch.cat([used_prompts[used.index(p)].image_grid_thw, *(t.image_grid_thw for t in turns)]) for p, turns in zip(row_prompt, turns_of_row, strict=True))]
    ).to(grids.image.device)  # fmt: skip
    return row_vision, VisionGrids(image_grid, grids.video, grids.video_seconds)


def _continue_block(
    policy: Policy, cache, mask: torch.Tensor, next_position: torch.Tensor, rows: Sequence[Sequence[int]], images=None
):
    """Feed one right-padded block of tokens per row after what ``cache`` holds (it grows in place).
    ``mask`` [N, L] is the cache's attention mask, ``next_position`` [N] each row's next position; ``images``
    (the block's image grids [n, 3] in row order, their vision outputs) when the block holds tool-turn images.
    Returns (hidden states [N, max(W, 1), H], the mask extended to [N, L + max(W, 1)], each row's next
    position); W = 0 feeds one masked pad column."""
    device = policy.device
    ids, block_mask = _right_pad(rows, policy.pad_token_id)
    if ids.shape[1] == 0:
        # Every row's block is empty (one-token answers, empty thoughts): the decoder still runs, on one masked
        # pad column, because under FSDP each layer's forward all-gathers its parameters and every process must
        # issue the same collectives whatever its rows hold. Callers read only the first W hidden states of a
        # block; shared_prefix_logprobs ties the rest into the result with weight 0 (the same backward too).
        ids = torch.full((len(rows), 1), policy.pad_token_id, dtype=torch.long)
        block_mask = torch.zeros((len(rows), 1), dtype=torch.long)
    ids, block_mask = ids.to(device), block_mask.to(device)
    mask = torch.cat([mask, block_mask], dim=1)
    mark_block(cache, block_mask)
    grid, vision = images if images is not None else (_no_grid().to(device), None)
    positions, next_position = continued_positions(policy, ids, block_mask, grid, next_position)
    hidden = policy.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
        **_cache_argument(policy.model.model, cache), **_vision_inputs(None if vision is None else {"image": vision}),
    ).last_hidden_state  # fmt: skip
    return hidden, mask, next_position


def shared_prefix_logprobs(
    policy: Policy,
    prompts: Sequence[EncodedPrompt],
    row_prompt: Sequence[int],
    completions: Sequence[Sequence[int]],
    thought_lengths: Sequence[int],
    *,
    temperature: float,
    thought_turns: Sequence[Sequence[ToolTurn]] | None = None,
) -> torch.Tensor:
    """What ``sequence_logprobs`` returns, computed the way the rollout samples: each prompt once, each
    distinct thought once on its prompt's KV cache (its tool turns ``thought_turns[r]`` and their images
    included), each answer on its thought's cache. Row r's completion is the thought
    ``completions[r][:thought_lengths[r]]`` followed by its answer; rows with the same prompt and thought share
    that computation, and gradients flow back through the cache into it.

    Re-encoding rows instead encodes a prompt (its image tokens included) K*M times and each thought M times;
    with the embedded model's T4A4 rows that is about 5x the tokens. transformers drops the cache under
    gradient checkpointing, so that setting re-encodes (``CompletionScorer``).
    """
    device = policy.device
    keys = [(p, tuple(c[:t])) for p, c, t in zip(row_prompt, completions, thought_lengths, strict=True)]
    thought_index = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # distinct (prompt, thought) pairs
    thought_keys = list(thought_index)
    thought_of_row = [thought_index[key] for key in keys]
    used = list(dict.fromkeys(row_prompt))  # distinct prompts
    prompt_of_thought = [used.index(p) for p, _ in thought_keys]
    thoughts = [list(thought) for _, thought in thought_keys]
    answers = [list(c[t:]) for c, t in zip(completions, thought_lengths, strict=True)]
    first_row = {i: r for r, i in reversed(list(enumerate(thought_of_row)))}
    turns = [list(thought_turns[first_row[i]]) if thought_turns is not None else [] for i in range(len(thoughts))]

    # 1. The distinct prompts, right-padded: every attention row keeps a real key (left padding would leave
    # fully masked rows, whose NaN-prone softmax would now sit on the backward path).
    ids, mask = _right_pad([prompts[p].input_ids for p in used], policy.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    # the prompts' images and the thoughts' tool-turn images in one call of the tower
    vision, grids, turn_vision = _encode_vision(policy, [prompts[p] for p in used], [t for ts in turns for t in ts])
    # no image in this micro-batch: the tower runs anyway, where it would have run (see idle_vision_term)
    idle_vision = idle_vision_term(policy) if vision is None and turn_vision is None else None
    positions = _rope_positions(policy, ids, mask, grids)
    cache = new_cache(policy)
    mark_block(cache, mask)
    prompt_hidden = policy.model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
        **_cache_argument(policy.model.model, cache), **_vision_inputs(vision),
    ).last_hidden_state  # fmt: skip
    prompt_last = prompt_hidden[torch.arange(len(used), device=device), mask.sum(1) - 1]  # [U, H]
    next_position = positions.masked_fill(mask[None] == 0, -1).amax(dim=(0, 2)) + 1  # [U]

    # 2. Each distinct thought on its prompt's cache.
    select = torch.tensor(prompt_of_thought, device=device)
    cache.reorder_cache(select)  # index_select: differentiable, gradients of all K thoughts add up in the prompt
    turn_images = None
    if turn_vision is not None:
        turn_images = (torch.cat([t.image_grid_thw for ts in turns for t in ts]).to(device), turn_vision)
    thought_hidden, mask, next_position = _continue_block(policy, cache, mask[select], next_position[select], thoughts, turn_images)
    thought_length = torch.tensor([len(t) for t in thoughts], device=device)

    # 3. Each answer on its thought's cache, without its last token (whose output predicts nothing scored).
    select = torch.tensor(thought_of_row, device=device)
    cache.reorder_cache(select)
    answer_hidden, _, _ = _continue_block(policy, cache, mask[select], next_position[select], [a[:-1] for a in answers])

    # The hidden state that predicts each scored token: thought token 0 <- the prompt's last position, thought
    # token j <- thought position j - 1, answer token 0 <- the thought's last position (the prompt's for an
    # empty thought), answer token j <- answer position j - 1.
    before_thought = torch.cat([prompt_last[prompt_of_thought][:, None], thought_hidden], dim=1)  # [Tn, Wt + 1, H]
    thought_end = before_thought[torch.arange(len(thoughts), device=device), thought_length]  # [Tn, H]
    before_answer = torch.cat([thought_end[select][:, None], answer_hidden], dim=1)  # [N, Wa, H]
    thought_targets, _ = _right_pad(thoughts, 0)
    answer_targets, _ = _right_pad(answers, 0)
    thought_logprobs = _token_logprobs(policy, before_thought[:, : thought_targets.shape[1]], thought_targets, temperature)
    answer_logprobs = _token_logprobs(policy, before_answer[:, : answer_targets.shape[1]], answer_targets, temperature)

    # Back to one row per answer, as sequence_logprobs lays them out: thought, answer, zero padding.
    width = max((len(c) for c in completions), default=0)
    rows = []
    for r, (t, answer) in enumerate(zip(thought_lengths, answers, strict=True)):
        padding = answer_logprobs.new_zeros(width - t - len(answer))
        rows.append(torch.cat([thought_logprobs[thought_of_row[r], :t], answer_logprobs[r, : len(answer)], padding]))
    if not rows:
        return torch.zeros((0, width), device=device)
    # Every pass's output is part of the result, whatever the rows hold, so that every process runs the same
    # backward (FSDP gathers and reduces per layer use): the pad columns of empty blocks, and the vision tower
    # on a micro-batch without images (idle_vision_term), enter with weight 0.
    unused = _zero_of(thought_hidden) + _zero_of(answer_hidden)
    if idle_vision is not None:
        unused = unused + idle_vision
    return _without_context(torch.stack(rows) + unused, thought_turns)


def _token_logprobs(policy: Policy, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs [N, T] of ``targets`` [N, T] under the policy, from the hidden states [N, T, H] predicting them.

    ``hidden`` is made contiguous first: a sliced [N, T, H] that requires grad, against a frozen head (LoRA, a
    frozen tied embedding), makes matmul copy the [H, V] weight N times for a batched product (at Qwen2-VL-2B's
    151,936 x 1,536 with 2 thought rows: 0.93 GB and a quarter of the CPU forward's time)."""
    logprobs = _policy_logprobs(policy.model.lm_head(hidden.contiguous()), temperature, policy.suppressed_token_ids)
    return logprobs.gather(-1, targets.to(hidden.device)[..., None]).squeeze(-1)
