"""docs/TASKS.md's "A task on the embedded scenes" example, run as written: loaded from a file outside the package by a
config entry, scored, trained one step and evaluated."""

import json
import re
from pathlib import Path

import pytest

from vlm_grpo_ma.run import cli
from vlm_grpo_ma.task_api.registry import Completion, get_task, import_task_modules
from vlm_grpo_ma.tools import evaluate as ev

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "TASKS.md"


REPO = GUIDE.parents[1]


@pytest.fixture(autouse=True)
def from_the_repository_root(monkeypatch):
    monkeypatch.chdir(REPO)  # the example reads the embedded scenes from there, as the guide says


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    section = GUIDE.read_text().split("## A task on the embedded scenes", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path_factory.mktemp("user") / "count_shapes.py"
    path.write_text(code)
    import_task_modules([str(path)])
    return path


def test_the_example_task_loads_and_scores(task_file):
    task = get_task("count_shapes")
    samples = task.load("test")
    assert len(samples) == 200 and all(2 <= s.answer <= 4 for s in samples)  # the scenes hold 2 to 4 shapes
    sample = samples[0]
    right = Completion("<think>count them</think>", f"<answer>{sample.answer}</answer>")
    wrong = Completion("<think>count them</think>", f"<answer>{sample.answer + 1}</answer>")
    assert task.reward(right, sample) == {"accuracy": 1.0, "format": 1.0, "reward": 1.5}
    assert task.reward(wrong, sample) == {"accuracy": 0.0, "format": 1.0, "reward": 0.5}
    assert task.reward(Completion("", "two <answer>"), sample) == {"accuracy": 0.0, "format": 0.0, "reward": 0.0}


def test_the_example_task_trains_and_evaluates_from_the_command_line(task_file, untrained_tiny_dir, tmp_path):
    run = tmp_path / "run"
    code = cli.main([
        "--task", "count_shapes", f"data.task_modules=[{task_file}]", f"model.name_or_path={untrained_tiny_dir}",
        f"train.output_dir={run}", "train.steps=1", "train.prompts_per_step=2", "rollout.num_thoughts=2",
        "rollout.num_answers=2", "rollout.max_thought_tokens=6", "rollout.max_answer_tokens=4",
        "logging.progress_bar=false", "logging.report_to=[]", "train.eval_every=0",
    ])
    assert code == 0
    assert "reward/accuracy" in json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert ev.main(["--models", str(run), "--tasks", "count_shapes", "--task-module", str(task_file), "--limit", "2",
                    "--max-thought-tokens", "4", "--max-answer-tokens", "4", "--output-dir", str(tmp_path / "e"),
                    "--no-progress"]) == 0


def test_the_guides_examples_import_only_the_task_api():
    """The README promises a task imports only vlm_grpo_ma.task_api (planted: the example's old
    ``from tasks.grounding import DATA_DIR``; the test failed naming it)."""
    import ast

    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) >= 2
    ours = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                ours += [node.module] if node.module.split(".")[0] in ("tasks", "vlm_grpo_ma") else []
            elif isinstance(node, ast.Import):
                ours += [a.name for a in node.names if a.name.split(".")[0] in ("tasks", "vlm_grpo_ma")]
    assert ours and set(ours) == {"vlm_grpo_ma.task_api"}
