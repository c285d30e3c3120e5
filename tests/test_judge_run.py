"""A run scored by a served judge, end to end against a real local server (tests/judge_server.py): the verdicts
reach the rewards, the cache's hits and the requests are logged, the API key reaches the server and no file of
the run folder; with the server stopped the run finishes with rewards 0, the failures counted and one warning;
settings that cannot work are refused at start, in one line."""

import json
import logging
import socket
from pathlib import Path

import pytest
from conftest import tiny_run_config
from judge_server import JudgeServer

from vlm_grpo_ma.run import cli
from vlm_grpo_ma.run.config import ConfigError, JudgeConfig
from vlm_grpo_ma.run.judge_setup import judge_for
from vlm_grpo_ma.run.loop import train
from vlm_grpo_ma.task_api.registry import get_task

JUDGED_TASK = str(Path(__file__).parent / "fixtures" / "judged_task.py")
SECRET = "sk-judge-test-5f1e2d3c4b5a69788796a5b4"


def judged_config(untrained_tiny_dir, out_dir, base_url, *extra):
    return tiny_run_config(
        untrained_tiny_dir, out_dir, f"data.task_modules=[{JUDGED_TASK}]", "data.task=judged_parity",
        "rollout.num_answers=4", f"judge.base_url={base_url}", "judge.model=judge-model", *extra, steps=2,
    )  # fmt: skip


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def dead_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/v1"


def test_a_run_is_scored_by_the_judge_logs_its_cache_and_keeps_the_key_out_of_its_folder(untrained_tiny_dir, tmp_path, monkeypatch):
    server = JudgeServer(api_key=SECRET)
    monkeypatch.setenv("JUDGE_TEST_KEY", SECRET)
    try:
        cfg = judged_config(untrained_tiny_dir, tmp_path / "run", server.base_url, "judge.api_key_env=JUDGE_TEST_KEY")
        train(cfg)
    finally:
        server.stop()
    steps = records(tmp_path / "run")
    assert len(steps) == 2
    answers = 2 * 2 * 4  # prompts x K x M a step
    assert sum(step["judge/requests"] for step in steps) == len(server.requests) > 0
    assert all(step["judge/requests"] < answers for step in steps)  # each step's repeated queries asked once
    assert all(step["judge/cache_hit_rate"] > 0 for step in steps)
    assert steps[-1]["count/judge_queries"] == 2 * answers and steps[-1].get("count/judge_failures", 0) == 0
    assert {header["Authorization"] for header in server.headers} == {f"Bearer {SECRET}"}
    assert 0 < sum(step["reward/mean"] for step in steps) < 2  # the server's yes and no both reached the rewards
    assert (tmp_path / "run" / "judge_cache.sqlite").is_file()
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_with_the_judge_stopped_the_run_finishes_with_rewards_0_counted_and_one_warning(untrained_tiny_dir, tmp_path, caplog):
    cfg = judged_config(untrained_tiny_dir, tmp_path / "run", dead_url(), "judge.retries=1")
    with caplog.at_level(logging.WARNING, logger="vlm_grpo_ma.judge"):
        train(cfg)
    steps = records(tmp_path / "run")
    assert [step["reward/mean"] for step in steps] == [0.0, 0.0]
    assert steps[-1]["count/judge_failures"] == steps[-1]["count/judge_queries"] == 2 * 2 * 2 * 4
    warnings = [r.getMessage() for r in caplog.records if r.name == "vlm_grpo_ma.judge"]
    assert len(warnings) == 1 and "unreachable" in warnings[0], warnings


def test_settings_that_cannot_work_are_refused_in_one_line(tmp_path, monkeypatch):
    task = get_task("vqa_open")
    with pytest.raises(ConfigError, match=r"judge\.base_url .* judge\.model"):
        judge_for(JudgeConfig(), [task], tmp_path)
    assert judge_for(JudgeConfig(), [get_task("vqa")], tmp_path) is None  # no task asks a judge: none needed
    with pytest.raises(ConfigError, match="not an http"):
        judge_for(JudgeConfig(base_url="127.0.0.1:8000", model="m"), [task], tmp_path)
    with pytest.raises(ConfigError, match="JUDGE_UNSET_KEY is not set"):
        judge_for(JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="JUDGE_UNSET_KEY"), [task], tmp_path)
    with pytest.raises(ConfigError) as pasted:  # the key itself where its variable's name belongs: never echoed
        judge_for(JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_env=SECRET), [task], tmp_path)
    assert SECRET not in str(pasted.value) and "environment variable" in str(pasted.value)
    server = JudgeServer(api_key=SECRET)
    monkeypatch.setenv("JUDGE_TEST_KEY", SECRET)
    try:
        with pytest.raises(ConfigError, match="'other' is not served .* it serves: judge-model"):
            judge_for(JudgeConfig(base_url=server.base_url, model="other", api_key_env="JUDGE_TEST_KEY"), [task], tmp_path)
        with pytest.raises(ConfigError, match="HTTP 401"):  # a server that refuses the key
            judge_for(JudgeConfig(base_url=server.base_url, model="judge-model"), [task], tmp_path)
        judge = judge_for(JudgeConfig(base_url=server.base_url, model="judge-model", api_key_env="JUDGE_TEST_KEY"), [task], tmp_path)
        assert judge is not None and judge.model == "judge-model"
        judge.close()
    finally:
        server.stop()


def test_the_cli_refuses_a_judged_task_without_a_judge_in_one_line(tmp_path, capsys):
    code = cli.main(["--task", "vqa_open", "--output-dir", str(tmp_path / "run"), "train.steps=1", "logging.report_to=[]"])
    err = capsys.readouterr().err
    assert code == 2 and "judge.base_url" in err and "Traceback" not in err


def test_evaluate_scores_a_judged_task_with_the_judge_and_refuses_to_resume_under_another(untrained_tiny_dir, tmp_path, capsys):
    from vlm_grpo_ma.tools import evaluate

    server = JudgeServer()
    args = ["--models", str(untrained_tiny_dir), "--task-module", JUDGED_TASK, "--tasks", "judged_parity", "--limit", "3",
            "--max-thought-tokens", "4", "--max-answer-tokens", "5", "--draw", "0", "--no-progress",
            "--output-dir", str(tmp_path / "eval"), "--judge", f"base_url={server.base_url}"]  # fmt: skip
    try:
        assert evaluate.main([*args, "--judge", "model=judge-model"]) == 0
        assert len(server.requests) > 0
        # another judge (here its verdict format): its numbers would mix with the first one's
        assert evaluate.main([*args, "--judge", "model=judge-model", "--judge", "verdict=score"]) == 2
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert "'verdict': 'score'" in err and "other settings" in err
    records = [json.loads(line) for line in next((tmp_path / "eval").rglob("samples.jsonl")).read_text().splitlines()]
    assert len(records) == 3 and all("accuracy" in r["parts"] for r in records)


def test_the_vqa_open_preset_asks_the_judge_and_its_m_answers_hit_the_cache(tmp_path):
    from vlm_grpo_ma.run.config_files import load_config

    root = Path(__file__).resolve().parents[1]
    server = JudgeServer()
    try:
        cfg = load_config(root / "configs" / "tiny-vqa_open.yaml", [
            f"model.name_or_path={root / 'vlm_grpo_ma/assets/tiny-qwen2.5-vl-vqa_open'}", f"train.output_dir={tmp_path / 'run'}",
            "train.steps=2", "train.prompts_per_step=4", "train.eval_every=0", "logging.report_to=[]", "logging.progress_bar=false",
            f"judge.base_url={server.base_url}", "judge.model=judge-model",
        ])  # fmt: skip
        train(cfg)
    finally:
        server.stop()
    steps = records(tmp_path / "run")
    assert all(step["judge/queries"] > 0 and "judge/cache_hit_rate" in step for step in steps)
    assert steps[0]["judge/cache_hit_rate"] > 0 and steps[-1]["count/judge_cache_hits"] > 0  # M = 4 answers repeat
    assert sum(step["reward/accuracy"] for step in steps) > 0  # the test server said yes to some answers
