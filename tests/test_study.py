"""The study: the report's arithmetic on hand-made runs, and the --quick grid end to end (resumable)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from vlm_grpo_ma.tools import study, study_report, study_runs


def _write_run(run_dir, rewards, step_seconds, tokens, noise=None, within=None, spikes=None, evals=(), start=0.3, right=None):
    """A hand-made run: ``evals`` are (step, held-out iou) pairs after the step-0 evaluation at ``start``;
    accuracy is iou / 2 and the right-thought share ``right`` (or absent)."""
    run_dir.mkdir(parents=True)

    def held_out(value):
        figures = {"eval/grounding/iou": value, "eval/grounding/accuracy": value / 2}
        return figures | ({"eval/grounding/right_thought": right} if right is not None else {})

    lines = [json.dumps({"step": 0, **held_out(start)})]
    for i, reward in enumerate(rewards):
        record = {"step": i + 1, "reward/mean": reward, "time/step_seconds": step_seconds, "time/rollout_seconds": step_seconds / 2,
                  "rollout/generated_tokens": tokens, "grpo_ma/thought_value_noise_var": noise,
                  "grpo_ma/answer_reward_var": within, "train/grad_norm_spike_ratio": (spikes or {}).get(i + 1),
                  "reward/right_thought": right}
        if i + 1 in dict(evals):
            record |= held_out(dict(evals)[i + 1])
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _grid(names, seeds=(0,)):
    return study_runs.Grid(tuple(study_runs.Setting.parse(n) for n in names), tuple(seeds), steps=10, prompts_per_step=2,
                      eval_every=5, eval_samples=2)


def _summaries(grid, root):
    held_out = study_runs.held_out_metrics("grounding")
    return [study_runs.SettingSummary(s, [study_runs.read_run(grid.run_dir(root, s, seed), "grounding", held_out) for seed in grid.seeds])
            for s in grid.settings]  # fmt: skip


def test_crossing_step_interpolates_between_evaluations():
    steps, values = [0, 25, 50], [0.2, 0.3, 0.5]
    assert study_runs.crossing_step(steps, values, 0.4) == pytest.approx(37.5)
    assert study_runs.crossing_step(steps, values, 0.5) == pytest.approx(50.0)
    assert study_runs.crossing_step(steps, values, 0.1) == 0.0  # there from the start
    assert study_runs.crossing_step(steps, values, 0.6) is None
    # a curve that dips: the first crossing counts
    assert study_runs.crossing_step([0, 10, 20, 30], [0.1, 0.5, 0.2, 0.6], 0.3) == pytest.approx(5.0)


def test_wall_time_and_tokens_at_a_fractional_step(tmp_path):
    grid = _grid(["T4A4"])
    _write_run(grid.run_dir(tmp_path, grid.settings[0], 0), [0.5] * 4, 2.0, 100)
    (summary,) = _summaries(grid, tmp_path)
    run = summary.runs[0]
    assert run.position(0) == (0.0, 0.0)
    assert run.position(2.5) == pytest.approx((5.0, 250.0))
    assert run.position(4) == (8.0, 400.0)


def test_time_and_tokens_to_reach_the_reference_held_out_figure_hand_computed(tmp_path):
    grid = _grid(["T16A1", "T4A4", "T2A8"], seeds=(0, 1))
    for seed in (0, 1):
        # T16A1: held-out 0.3 -> 0.4 -> 0.5 at steps 0, 5, 10; 2 s and 100 tokens a step
        _write_run(grid.run_dir(tmp_path, grid.settings[0], seed), [0.5] * 10, 2.0, 100, evals=[(5, 0.4), (10, 0.5)],
                   spikes={i: 1.0 for i in range(1, 11)} | {10: 3.0}, right=0.5)  # fmt: skip
        # T4A4: reaches 0.5 at step 5 (seed 0) or 2/5 of the way to step 5 (seed 1, 0.3 -> 0.8); 1 s, 50 tokens
        _write_run(grid.run_dir(tmp_path, grid.settings[1], seed), [0.6] * 10, 1.0, 50, noise=0.02, within=0.08,
                   evals=[(5, 0.5 if seed == 0 else 0.8), (10, 0.55)], right=0.6)  # fmt: skip
        # T2A8: never reaches 0.5
        _write_run(grid.run_dir(tmp_path, grid.settings[2], seed), [0.6] * 10, 1.5, 80, noise=0.01, within=0.08,
                   evals=[(5, 0.35), (10, 0.45)], right=0.6)  # fmt: skip
    reference, grpo_ma, short = _summaries(grid, tmp_path)
    assert reference.eval_curve("iou") == pytest.approx([0.3, 0.4, 0.5])
    assert reference.reach("iou", 0.5) == (10.0, 20.0, 1000.0)
    # seed-mean curve 0.3 -> 0.65 -> 0.55: 0.5 at step 5 * 0.2 / 0.35
    step, seconds, tokens = grpo_ma.reach("iou", 0.5)
    assert step == pytest.approx(20 / 7) and seconds == pytest.approx(20 / 7) and tokens == pytest.approx(1000 / 7)
    assert grpo_ma.reach_per_seed("iou", 0.5) == pytest.approx([5.0, 2.0])
    assert short.reach("iou", 0.5)[0] is None and all(math.isnan(v) for v in short.reach_per_seed("iou", 0.5))

    report = study_report.write_report(grid, tmp_path, task="grounding", command="python -m vlm_grpo_ma.study").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in report.splitlines()
            if line.startswith("| T") and "GRPO" in line}  # fmt: skip
    assert rows["T16A1"][:9] == ["GRPO (flat, prompt baseline)", "0.300 -> 0.500 (0.500-0.500)", "0.15 -> 0.25 (0.25-0.25)",
                                 "10", "20", "1.00", "1,000", "1.00", "20-20"]  # fmt: skip
    assert rows["T4A4"][:9] == ["GRPO-MA (thought baseline)", "0.300 -> 0.550 (0.550-0.550)", "0.15 -> 0.28 (0.28-0.28)",
                                "3", "3", "0.14", "143", "0.14", "2-5"]  # fmt: skip
    assert rows["T2A8"][3] == "not reached" and rows["T2A8"][8] == "not reached"
    assert rows["T16A1"][12] == "0.100-0.100"  # spike score: 1 step of 10 above 2x, both seeds
    assert "**T4A4** (GRPO-MA (thought baseline)) reached it at step 3, in 0.14x T16A1's wall time" in report
    assert "every seed of it reached the target before every seed of T16A1" in report
    assert "**T2A8** (GRPO-MA (thought baseline)) did not reach it" in report
    assert "| T4A4 | 0.60 -> 0.60 (0.60-0.60) | 0.600 -> 0.600 |" in report  # right thoughts: held-out, sampled
    assert [point[:2] for point in study_report.noise_points([grpo_ma, short])] == [("T4A4", 4), ("T2A8", 8)]
    assert [point[2] for point in study_report.noise_points([grpo_ma, short])] == pytest.approx([0.02, 0.01])
    linked = re.findall(r"!\[([^]]+)\]\(([^)]+)\)", report)
    assert {name for name, _ in linked} == {"heldout.png", "accuracy.png", "right_thoughts.png", "reward.png", "step_time.png",
                                            "spike_score.png", "noise_vs_m.png"}  # fmt: skip
    for name, target in linked:
        assert name == target and (tmp_path / target).stat().st_size > 1000, name


def test_overlapping_seeds_are_called_noise(tmp_path):
    grid = _grid(["T16A1", "T4A4"], seeds=(0, 1))
    for seed, (ref_at, ma_at) in enumerate([(5, 10), (10, 5)]):  # each setting first on one seed
        _write_run(grid.run_dir(tmp_path, grid.settings[0], seed), [0.5] * 10, 1.0, 100, evals=[(ref_at, 0.5), (15 - ref_at, 0.5)])
        _write_run(grid.run_dir(tmp_path, grid.settings[1], seed), [0.5] * 10, 1.0, 100, evals=[(ma_at, 0.5), (15 - ma_at, 0.5)])
    report = study_report.write_report(grid, tmp_path, task="grounding", command="python -m vlm_grpo_ma.study").read_text()
    assert "the seeds' own times overlap, so the difference is within seed noise" in report


def test_the_variance_section_and_setting(tmp_path):
    from vlm_grpo_ma.tools import variance

    grid = _grid(["T16A1", "T4A4"])
    for setting in grid.settings:
        _write_run(grid.run_dir(tmp_path, setting, 0), [0.5] * 10, 1.0, 100, evals=[(5, 0.4), (10, 0.5)])
    assert study_runs.variance_setting(grid, None).name == "T4A4"
    with pytest.raises(ValueError, match="K >= 2"):
        study_runs.variance_setting(_grid(["T1A4"]), None)
    with pytest.raises(ValueError, match="the grid has T16A1, T4A4"):
        study_runs.variance_setting(grid, "T8A2")
    rewards = torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    results = variance.measure(rewards, (1, 2), resamples=4, scale_by_std=True, eps=1e-6, unbiased=False)
    variance.write_outputs(results, {"run": "r", "checkpoint": "r@step-10", "prompts": 2, "thoughts": 4, "answers_per_thought": 8},
                           tmp_path / "variance", 4)  # fmt: skip
    report = study_report.write_report(grid, tmp_path, task="grounding", command="c", report_dir=tmp_path / "docs").read_text()
    assert "## The thought advantage's variance against M, measured" in report and variance.table(results) in report
    assert (tmp_path / "docs" / "variance.png").is_file() and (tmp_path / "docs" / "report.md").is_file()


@pytest.mark.parametrize("name", ["T0A4", "4x4", "T4A", "t4a4"])
def test_a_bad_setting_names_the_form(name):
    with pytest.raises(ValueError, match="T<K>A<M>"):
        study_runs.Setting.parse(name)


def test_cli_errors_name_the_bad_value(capsys):
    assert study.main(["--settings", "T4B4"]) == 2
    assert "T<K>A<M>" in capsys.readouterr().err
    assert study.main(["--seeds", "0"]) == 2
    assert "--seeds=0 must be >= 1" in capsys.readouterr().err


def test_every_run_starts_from_the_config_file_with_the_grid_on_top(tmp_path, capsys):
    config = tmp_path / "regime.yaml"
    config.write_text("train:\n  learning_rate: 0.001\n")
    fake_python = tmp_path / "python"  # records each run's command line instead of training
    fake_python.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'commands'}\n")
    fake_python.chmod(0o755)
    args = study.build_arg_parser().parse_intermixed_args(
        ["--settings", "T4A4", "--seeds", "1", "--config", str(config), "train.num_threads=1"])
    grid = study.grid_from_args(args)
    study_runs.run_grid(grid, tmp_path / "out", task="math", python=str(fake_python), log=lambda line: None)
    command = (tmp_path / "commands").read_text().split()
    assert command[command.index("--config") + 1] == str(config)
    assert command.index("--config") < command.index("rollout.num_thoughts=4")  # the grid's overrides win
    assert command[-1] == "train.num_threads=1"
    assert study.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert f"--config {tmp_path / 'missing.yaml'}: no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_grid_runs_writes_the_report_and_resumes(tmp_path, capsys):
    out = tmp_path / "study"
    assert study.main(["--quick", "--jobs", "2", "--output-dir", str(out), "train.num_threads=1"]) == 0
    report = (out / "report.md").read_text()
    assert "| T4A1 | GRPO" in report and "| T2A2 | GRPO-MA" in report and "| 2 | " in report  # the variance table, M = 2
    for name in re.findall(r"!\[[^]]+\]\(([^)]+)\)", report):
        assert (out / name).is_file(), name
    assert "variance.png" in report and (out / "variance" / "variance.json").is_file()
    # a run interrupted after its first checkpoint continues; finished runs are kept as they are
    interrupted = out / "runs" / "T2A2-seed1"
    kept = (out / "runs" / "T4A1-seed0" / "metrics.jsonl").read_text()
    (interrupted / "summary.json").unlink()
    capsys.readouterr()
    assert study.main(["--quick", "--jobs", "2", "--output-dir", str(out), "train.num_threads=1"]) == 0
    printed = capsys.readouterr().out
    assert "T2A2 seed 1: resuming" in printed and printed.count("done earlier, kept") == 4  # three runs, the variance
    assert (interrupted / "summary.json").is_file()
    assert (out / "runs" / "T4A1-seed0" / "metrics.jsonl").read_text() == kept


def test_equal_wall_time_and_equal_thought_count_comparisons(tmp_path):
    grid = _grid(["T16A1", "T4A4", "T4A1"], seeds=(0, 1))
    for seed in (0, 1):
        _write_run(grid.run_dir(tmp_path, grid.settings[0], seed), [0.5] * 10, 2.0, 100, evals=[(5, 0.4), (10, 0.5)])
        _write_run(grid.run_dir(tmp_path, grid.settings[1], seed), [0.5] * 10, 1.0, 60, evals=[(5, 0.45), (10, 0.48)])
        _write_run(grid.run_dir(tmp_path, grid.settings[2], seed), [0.5] * 10, 1.0, 20, evals=[(5, 0.35), (10, 0.38)])
    reference, grpo_ma, grpo = _summaries(grid, tmp_path)
    # T16A1's evaluations sit at 0, 10 and 20 s: after 15 s, half-way from 0.4 to 0.5; past 20 s, unknown
    assert reference.runs[0].held_out_at_seconds("iou", 15.0) == pytest.approx(0.45)
    assert math.isnan(reference.runs[0].held_out_at_seconds("iou", 21.0))
    # T4A4 ends after 10 s at 0.48, where T16A1 stood at 0.40
    assert study_report.equal_time(grpo_ma, reference, "iou") == (
        "At equal training wall time (10 s, T4A4's end) T4A4 stood at 0.480 against T16A1's 0.400: ahead of T16A1 on every seed.")
    (line,) = study_report.equal_thoughts([reference, grpo_ma, grpo], reference, "iou")
    assert line.startswith("- **T4A4 against T4A1** (the same 4 thoughts, 4 answers each instead of 1): after the same 10 steps "
                           "0.480 against 0.380, ahead of T4A1 on every seed. At equal training wall time (10 s, T4A1's end) "
                           "T4A1 stood at 0.380 against T4A4's 0.480: behind T4A4 on every seed.")  # fmt: skip
    claims = "\n".join(study_report.claims([reference, grpo_ma, grpo], reference, None, "iou"))
    assert "*What a step buys (T4A4).* After the same 10 steps its held-out iou is 0.480 against T16A1's 0.500" in claims
    assert "its step costs 0.50x T16A1's" in claims


@pytest.mark.parametrize("report", sorted((Path(__file__).resolve().parents[1] / "docs" / "study").rglob("report.md")),
                         ids=lambda path: str(path.parent.name))
def test_every_image_a_committed_report_links_is_committed(report):
    linked = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report.read_text())
    assert linked and all((report.parent / name).is_file() for name in linked), [n for n in linked if not (report.parent / n).is_file()]
    assert report.read_text().startswith("# GRPO-MA study\n\nCommand: `python -m vlm_grpo_ma.study ")


def test_a_short_study_says_what_it_cannot_tell(tmp_path):
    """Two steps, as ``--quick`` runs: the held-out figure never moves from the start, and no step is past the
    spike window. The report said 'reached it at step 0, in n/ax T16A1's wall time' and called unknown spike
    scores 'not reached'. Planted back (the old text), both assertions failed."""
    grid = _grid(["T16A1", "T4A4"], seeds=(0, 1))
    for setting in grid.settings:
        for seed in grid.seeds:
            _write_run(grid.run_dir(tmp_path, setting, seed), [0.5, 0.5], 1.0, 50, evals=[(2, 0.3)], start=0.3)
    reference, grpo_ma = _summaries(grid, tmp_path)
    (line,) = study_report.verdict([reference, grpo_ma], reference, "iou", reference.eval_curve("iou")[-1])
    assert line.startswith("- **T4A4** (GRPO-MA (thought baseline)) stood at it from step 0, before any training, so there is no time to compare.")
    assert "n/a" not in line
    claims = "\n".join(study_report.claims([reference, grpo_ma], reference, None, "iou"))
    assert f"Spike score T16A1 {study_report.NO_SPIKE_SCORE}; T4A4 {study_report.NO_SPIKE_SCORE}." in claims
    assert "not reached" not in claims
