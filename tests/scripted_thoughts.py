"""Thoughts whose text a test chooses, decoded by the real sampler: the tokens the "model" picks are scripted,
row by row, while every log-prob, the KV cache, the tool turns fed between them and the positions are the
sampler's own. Used where an untrained model would never write a tool call.

``scripted(monkeypatch, policy, scripts)``: thought row r writes ``scripts[r]`` (a list of texts: the model's
own segments, the tool turns fall between them); rows without a script, and every answer, sample as usual."""

from __future__ import annotations

from vlm_grpo_ma.engines import decode
from vlm_grpo_ma.model.logprobs import _policy_logprobs


def scripted(monkeypatch, policy, scripts: dict[int, list[str]], num_thought_rows: int):
    encode = lambda text: policy.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    planned = {row: [t for text in texts for t in encode(text)] for row, texts in scripts.items()}
    written = {row: 0 for row in planned}  # the model's own tokens fed so far, per thought row
    real_sample, real_step = decode._sample_tokens, decode._step

    def sample(logits, settings, suppressed):
        tokens, values = real_sample(logits, settings, suppressed)
        if logits.shape[0] != num_thought_rows:
            return tokens, values
        logprobs = _policy_logprobs(logits, settings.temperature or 1.0, suppressed)
        tokens = tokens.clone()
        for row, plan in planned.items():
            if written[row] < len(plan):
                tokens[row] = plan[written[row]]
        return tokens, logprobs.gather(-1, tokens[:, None].to(logprobs.device)).squeeze(-1)

    def step(policy_, state, tokens, real):
        if tokens.shape[0] == num_thought_rows:
            for row in planned:
                written[row] += int(real[row])
        return real_step(policy_, state, tokens, real)

    monkeypatch.setattr(decode, "_sample_tokens", sample)
    monkeypatch.setattr(decode, "_step", step)
    return written
