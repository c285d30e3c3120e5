import json

import pytest

from vlm_grpo_ma.run.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints
from vlm_grpo_ma.run.metrics import format_summary, read_metrics, summarize


def test_summary_compares_first_and_last_fifth():
    records = [{"step": s, "reward/mean": float(s), "reward/iou": 0.1} for s in range(1, 11)]
    summary = summarize(records)
    assert summary["steps_per_fifth"] == 2
    assert summary["reward/mean"]["first_fifth"] == 1.5
    assert summary["reward/mean"]["last_fifth"] == 9.5
    assert summary["reward/mean"]["gain"] == 8.0
    assert summary["reward/mean"]["step_noise_std"] == pytest.approx(0.5**0.5, abs=1e-12)
    # first fifth {1, 2}, last {9, 10}: each has variance 1/2 over 2 steps -> sqrt(1/4 + 1/4)
    assert summary["reward/mean"]["gain_standard_error"] == pytest.approx(0.5**0.5, abs=1e-12)
    assert summary["reward/iou"]["gain_standard_error"] == 0.0
    assert summary["reward/iou"]["gain"] == 0.0
    assert "first fifth 1.5000" in format_summary(summary)


def test_read_metrics_keeps_the_last_record_of_a_relogged_step(tmp_path):
    lines = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.1, 0.25]


def test_half_written_checkpoints_are_never_picked(tmp_path):
    done = checkpoint_dir(tmp_path, 4)
    done.mkdir(parents=True)
    (done / "state.pt").write_bytes(b"x")
    partial = checkpoint_dir(tmp_path, 6).with_name("step-000006.tmp")  # a crash during save leaves this
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"x")
    no_state = checkpoint_dir(tmp_path, 8)  # a folder without its state file is not a checkpoint
    no_state.mkdir()
    assert list_checkpoints(tmp_path) == [done]
    assert latest_checkpoint(tmp_path) == done
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_resume_restores_only_the_cuda_rng_states_of_visible_gpus(monkeypatch):
    """A checkpoint written with 4 GPUs visible resumes on 2: states 0 and 1 are restored, 2 and 3 are not
    asked for (torch.cuda.set_rng_state_all would raise an invalid device error for them)."""
    import random

    import torch

    from vlm_grpo_ma.run import checkpoint

    assert checkpoint.cuda_states_to_restore(["s0", "s1", "s2", "s3"], 2) == [(0, "s0"), (1, "s1")]
    assert checkpoint.cuda_states_to_restore(["s0"], 8) == [(0, "s0")]  # more GPUs now: the rest keep their seed
    restored = []

    def set_state(state, device="cuda"):
        if device >= 2:
            raise RuntimeError(f"invalid device ordinal {device}")
        restored.append((device, int(state[0])))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_state)  # what set_rng_state_all calls
    saved = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": [torch.tensor([d]) for d in range(4)]}
    checkpoint.set_rng_state(saved)
    assert restored == [(0, 0), (1, 1)]


def test_a_short_run_prints_n_a_where_a_spread_has_too_few_steps():
    """Two steps make fifths of one step: no step-to-step spread and no standard error (NaN), and an evaluation
    figure no sample had is null in metrics.jsonl. The summary printed "nan" spreads, and a null evaluation
    figure raised TypeError. Planted: the figures formatted as they were ("std nan"; the TypeError)."""
    records = [{"step": 0, "eval/grounding/iou": 0.25, "eval/grounding/acc": None},
               {"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75, "eval/grounding/iou": 0.5, "eval/grounding/acc": None}]  # fmt: skip
    text = format_summary(summarize(records, keys=("reward/mean",)))
    assert "nan" not in text.lower()
    assert "reward/mean    first fifth 0.5000   last fifth 0.7500   gain +0.2500 (standard error n/a)   step-to-step std n/a" in text
    assert "eval/grounding/iou             step 0: 0.2500   step 2: 0.5000" in text
    assert "eval/grounding/acc             step 0: n/a   step 2: n/a" in text
