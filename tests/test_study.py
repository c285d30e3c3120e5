"""The study: the report's arithmetic on hand-made runs, and the --quick grid end to end (resumable)."""

import json
import math

import pytest

from vlm_grpo_ma import study


def _write_run(run_dir, rewards, step_seconds, tokens, noise=None, within=None, spikes=None, evals=()):
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": 0, "eval/grounding/iou": 0.3})]
    for i, reward in enumerate(rewards):
        record = {"step": i + 1, "reward/mean": reward, "time/step_seconds": step_seconds, "time/rollout_seconds": step_seconds / 2,
                  "rollout/generated_tokens": tokens, "grpo_ma/thought_value_noise_var": noise,
                  "grpo_ma/answer_reward_var": within, "train/grad_norm_spike_ratio": (spikes or {}).get(i + 1)}
        if i + 1 in dict(evals):
            record["eval/grounding/iou"] = dict(evals)[i + 1]
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _grid(names, seeds=(0,)):
    return study.Grid(tuple(study.Setting.parse(n) for n in names), tuple(seeds), steps=10, prompts_per_step=2,
                      eval_every=5, eval_samples=2)


def test_time_and_tokens_to_reach_the_reference_level_hand_computed(tmp_path):
    grid = _grid(["T16A1", "T4A4"])
    # T16A1: reward 0 for 10 steps, then 1 for 10; 2 s and 100 tokens a step
    _write_run(grid.run_dir(tmp_path, grid.settings[0], 0), [0.0] * 10 + [1.0] * 10, 2.0, 100)
    # T4A4: reward 1.0 from the start, 1 s and 60 tokens a step
    _write_run(grid.run_dir(tmp_path, grid.settings[1], 0), [1.0] * 20, 1.0, 60, noise=0.01, within=0.04)
    summaries = [study.SettingSummary(s, [study.read_run(grid.run_dir(tmp_path, s, 0), "grounding", "iou")]) for s in grid.settings]
    reference, grpo_ma = summaries
    assert reference.final_reward() == pytest.approx(1.0)
    gain, error = reference.reward_gain()  # fifths of 4 steps: 0 -> 1; pstdev 0.5 * sqrt(1/4 + 1/4)
    assert gain == pytest.approx(1.0) and error == pytest.approx(0.5 * math.sqrt(0.5))
    # 10-step trailing means from step 10 on: 0, 0.1, 0.2, ..., 1.0; the first >= 0.5 is at step 15
    assert reference.to_reach(0.5) == (15, 30.0, 1500.0)
    assert reference.to_reach(1.01)[0] is None
    assert grpo_ma.to_reach(0.5) == (10, 10.0, 600.0)  # never before a full window
    assert reference.smoothed_reward()[-1] == pytest.approx(1.0)  # the report's target: where T16A1 ends
    assert reference.to_reach(1.0) == (20, 40.0, 2000.0)
    assert grpo_ma.rollout_seconds() == pytest.approx(0.5) and grpo_ma.update_seconds() == pytest.approx(0.5)
    assert grpo_ma.noise_var() == pytest.approx(0.01) and math.isnan(reference.noise_var())


def test_report_table_and_plots(tmp_path):
    grid = _grid(["T16A1", "T4A4", "T2A8"], seeds=(0, 1))
    for seed in (0, 1):
        _write_run(grid.run_dir(tmp_path, grid.settings[0], seed), [0.5] * 10, 2.0, 100, evals=[(5, 0.4), (10, 0.5)],
                   spikes={i: 1.0 for i in range(1, 11)} | {10: 3.0})
        _write_run(grid.run_dir(tmp_path, grid.settings[1], seed), [0.6] * 10, 1.0, 50, noise=0.02, within=0.08,
                   evals=[(5, 0.45), (10, 0.55)])
        _write_run(grid.run_dir(tmp_path, grid.settings[2], seed), [0.6] * 10, 1.5, 80, noise=0.01, within=0.08,
                   evals=[(5, 0.45), (10, 0.55)])
    report = study.write_report(grid, tmp_path, task="grounding", command="python -m vlm_grpo_ma.study").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in report.splitlines()
            if line.startswith("| T")}
    # target 0.5: T16A1 reaches it at step 10 in 20 s and 1,000 tokens; T4A4 in 10 s (0.50x) and 500 tokens (0.50x)
    assert rows["T16A1"][:6] == ["0.500", "10", "20", "1.00", "1,000", "1.00"]
    assert rows["T4A4"][:6] == ["0.600", "10", "10", "0.50", "500", "0.50"]
    assert rows["T2A8"][3] == "0.75" and rows["T2A8"][5] == "0.80"
    assert rows["T16A1"][8] == "0.100"  # spike score: 1 step of 10 above 2x
    summaries = [study.SettingSummary(s, [study.read_run(grid.run_dir(tmp_path, s, 0), "grounding", "iou")]) for s in grid.settings]
    assert [point[:2] for point in study.noise_points(summaries)] == [("T4A4", 4), ("T2A8", 8)]
    assert [point[2] for point in study.noise_points(summaries)] == pytest.approx([0.02, 0.01])
    assert rows["T4A4"][11] == "0.300 -> 0.550"
    assert "did not rise measurably" in report  # T16A1's reward is flat: the ratios compare noise  # held-out IoU: the step-0 evaluation, then steps 5 and 10
    for name in ("reward.png", "heldout.png", "noise_vs_m.png", "step_time.png", "spike_score.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
        assert f"![{name}]({name})" in report


@pytest.mark.parametrize("name", ["T0A4", "4x4", "T4A", "t4a4"])
def test_a_bad_setting_names_the_form(name):
    with pytest.raises(ValueError, match="T<K>A<M>"):
        study.Setting.parse(name)


def test_cli_errors_name_the_bad_value(capsys):
    assert study.main(["--settings", "T4B4"]) == 2
    assert "T<K>A<M>" in capsys.readouterr().err
    assert study.main(["--seeds", "0"]) == 2
    assert "--seeds=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_grid_runs_writes_the_report_and_resumes(tmp_path, capsys):
    out = tmp_path / "study"
    assert study.main(["--quick", "--output-dir", str(out), "train.num_threads=1"]) == 0
    report = (out / "report.md").read_text()
    assert "| T4A1 |" in report and "| T2A2 |" in report and (out / "noise_vs_m.png").is_file()
    # a run interrupted after its first checkpoint continues; finished runs are kept as they are
    interrupted = out / "runs" / "T2A2-seed1"
    kept = (out / "runs" / "T4A1-seed0" / "metrics.jsonl").read_text()
    (interrupted / "summary.json").unlink()
    capsys.readouterr()
    assert study.main(["--quick", "--output-dir", str(out), "train.num_threads=1"]) == 0
    printed = capsys.readouterr().out
    assert "T2A2 seed 1: resuming" in printed and printed.count("done earlier, kept") == 3
    assert (interrupted / "summary.json").is_file()
    assert (out / "runs" / "T4A1-seed0" / "metrics.jsonl").read_text() == kept
