"""Trackers (vlm_grpo_ma/run/trackers.py): a run with logging.report_to=[tensorboard,wandb,mlflow,swanlab,trackio]
writes each tracker's offline data, read back here through each library's own reader; a resumed run continues
the same tracker runs without duplicate steps; completions tables and held-out drawings reach W&B and MLflow;
a tracker that raises never stops the run.

One short run is shared by the end-to-end tests (module fixture ``tracked``): 5 steps on the embedded tiny
model (checkpoints at 3 and 5, held-out evaluation at 0 and 5, completions every 2 steps), then its step-5
checkpoint is deleted (as if the run had crashed after logging step 5 but before saving it) and it resumes to 6
steps: steps 4 and 5 run and are logged again, step 6 is new. Both runs are subprocesses of the CLI, so the
trackers' process-wide state (TRACKIO_DIR, W&B's service, SwanLab's signal handlers) stays out of pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_run_config
from PIL import Image, ImageChops

from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.config_files import load_config
from vlm_grpo_ma.run.trackers import TRACKERS, Tracker, check_trackers, open_trackers, register_tracker

EXTRA = "needs the trackers extra (pip install -e '.[trackers]'; .ci/run installs it)"
ALL = "[tensorboard,wandb,mlflow,swanlab,trackio]"
RUN = (
    "--task", "grounding", "train.prompts_per_step=2", "train.micro_batch_rows=4", "rollout.num_thoughts=2",
    "rollout.num_answers=2", "rollout.max_thought_tokens=16", "rollout.max_answer_tokens=20", "rollout.reward_workers=2", "logging.progress_bar=false", "train.checkpoint_every=3",
    "train.eval_every=5", "train.eval_samples=2", "logging.eval_drawings=2", "logging.rollout_every=2",
    f"logging.report_to={ALL}", "logging.tags=[test]",
)  # fmt: skip


def _train(run_dir: Path, home: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "SWANLAB_", "TRACKIO_"))}
    # W&B keeps settings, a cache and the staged files of logged tables under the user's folders: the test's own
    env.update(HF_HUB_OFFLINE="1", WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
               WANDB_DATA_DIR=str(home / "data"), HOME=str(home))  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "vlm_grpo_ma.train", "--output-dir", str(run_dir), *RUN, *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    for module in ("wandb", "mlflow", "swanlab", "trackio"):
        pytest.importorskip(module, reason=EXTRA)
    root = tmp_path_factory.mktemp("trackers")
    run, home = root / "run", root / "home"
    _train(run, home, "train.steps=5")
    first = {
        "ids": json.loads((run / "trackers.json").read_text()),
        "metrics": _records(run / "metrics.jsonl"),
        "wandb_dirs": sorted(p.name for p in (run / "wandb").glob("offline-run-*")),
    }
    shutil.rmtree(run / "checkpoints" / "step-000005")  # the crash: step 5 logged everywhere, not saved
    _train(run, home, "train.steps=6", "--resume")
    return {"run": run, "first": first}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reward_series(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["reward/mean"]) for r in _records(run / "metrics.jsonl") if "reward/mean" in r]


# ------------------------------------------------------------------------------ each library's own reader


def _wandb_records(path: Path):
    """The records of a W&B run file (``run-<id>.wandb``): the LevelDB log format W&B writes (a 7-byte file
    header ":W&B" + magic + version, then 32 KiB blocks of chunks with a 7-byte header: CRC, length, type 1 full
    / 2 first / 3 middle / 4 last), each record parsed with W&B's own protobuf. The SDK no longer ships a Python
    reader (its Go core reads them in `wandb sync`)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_history(run: Path) -> tuple[set[str], list[dict]]:
    """(run ids, history rows in order) over every offline run folder of the run."""
    ids, rows = set(), []
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        for record in _wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return ids, rows


def _mlflow_client(run: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run.resolve() / 'mlflow.db'}")


def _swanlab_scalars(run: Path, key: str) -> list[tuple[int, float]]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    series = []
    for path in sorted(run.glob("swanlog/run-*/run-*.swanlab")):
        reader = DataStoreReader()
        reader.open(path)
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "scalar" and record.scalar.key == key:
                series.append((record.scalar.step, record.scalar.value.number))
        reader.close()
    return series


def _trackio_logs(run: Path, name: str) -> list[dict]:
    """trackio's local database, read in a child process: trackio fixes its folder (TRACKIO_DIR) at import."""
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('vlm-grpo-ma', sys.argv[1]), default=str))")  # fmt: skip
    env = {**os.environ, "TRACKIO_DIR": str(run / "trackio")}
    out = subprocess.run([sys.executable, "-c", code, name], env=env, capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tensorboard_scalars(run: Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(key)]


# ------------------------------------------------------------------------------ the tests


@pytest.mark.slow
def test_every_tracker_holds_the_reward_series_of_metrics_jsonl(tracked):
    run = tracked["run"]
    expected = _reward_series(run)
    assert [s for s, _ in expected] == [1, 2, 3, 4, 5, 6]
    assert len({v for _, v in expected}) > 1  # a series that could be told apart from a wrong one
    ids = json.loads((run / "trackers.json").read_text())
    _, wandb_rows = _wandb_history(run)
    found = {
        "tensorboard": _tensorboard_scalars(run, "reward/mean"),
        "wandb": [(r["_step"], r["reward/mean"]) for r in wandb_rows if "reward/mean" in r],
        "mlflow": [(m.step, m.value) for m in _mlflow_client(run).get_metric_history(ids["mlflow"]["id"], "reward/mean")],
        "swanlab": _swanlab_scalars(run, "reward/mean"),
        "trackio": [(r["step"], r["reward/mean"]) for r in _trackio_logs(run, ids["trackio"]["id"]) if "reward/mean" in r],
    }
    for name, series in found.items():
        assert [s for s, _ in series] == [s for s, _ in expected], name
        assert [v for _, v in series] == pytest.approx([v for _, v in expected], rel=1e-6, abs=1e-7), name  # TB: float32


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs_without_duplicate_steps(tracked):
    run, first = tracked["run"], tracked["first"]
    ids = json.loads((run / "trackers.json").read_text())
    assert {k: v["id"] for k, v in ids.items()} == {k: v["id"] for k, v in first["ids"].items()}
    assert {k: v["last_step"] for k, v in ids.items()} == dict.fromkeys(ids, 6)
    # W&B: a second offline folder of the same run id; every step once across both
    folders = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(first["wandb_dirs"]) == 1 and len(folders) == 2
    run_ids, rows = _wandb_history(run)
    assert run_ids == {ids["wandb"]["id"]}
    steps = [r["_step"] for r in rows if "reward/mean" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    # MLflow: one run in the experiment, its history extended by step 6 only
    client = _mlflow_client(run)
    experiment = client.get_experiment_by_name("vlm-grpo-ma")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [ids["mlflow"]["id"]]
    assert [m.step for m in client.get_metric_history(ids["mlflow"]["id"], "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in client.get_metric_history(ids["mlflow"]["id"], "eval/grounding/reward")] == [0, 5, 6]
    # the values the trackers kept for steps 4 and 5 are those of metrics.jsonl (the first run's; the rerun is exact)
    before = {r["step"]: r["reward/mean"] for r in first["metrics"] if "reward/mean" in r}
    assert all(before[s] == v for s, v in _reward_series(run) if s in before)


@pytest.mark.slow
def test_completions_tables_and_drawings_reach_wandb_and_mlflow(tracked):
    run = tracked["run"]
    ids = json.loads((run / "trackers.json").read_text())
    trees = {(r["step"], r["sample_id"]): r for r in _records(run / "rollouts.jsonl")}
    # W&B: a table file per completions step (2, 4, 6), each row a thought of the step's dumped trees
    tables = sorted((run / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
    assert sorted(int(p.name.split("_")[1]) for p in tables) == [2, 4, 6]
    table = json.loads(next(p for p in tables if p.name.startswith("completions_2_")).read_text())
    assert table["columns"] == ["step", "sample_id", "task", "prompt", "image", "thought", "thought_advantage", "answers", "rewards"]
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) == 2 * 2  # 2 trees of 2 thoughts, in order
    for index, record in enumerate(rows):
        tree = trees[(2, record["sample_id"])]
        thought = tree["thoughts"][index % 2]
        assert record["prompt"] == tree["question"] and record["thought"] == thought["thought"]
        assert record["image"] == "Image"  # W&B's run file names the type; the pixels are in the table's artifact
        assert record["thought_advantage"] == pytest.approx(thought["thought_advantage"])
        assert json.loads(record["rewards"]) == pytest.approx([a["reward"] for a in thought["answers"]])
    # drawings of the evaluations at steps 0 and 5: W&B's copies hold the pixels the evaluation drew
    drawn = sorted((run / "eval" / "step-000000" / "draw" / "grounding").glob("*.png"))
    assert len(drawn) == 2
    in_wandb = sorted((run / "wandb").glob("offline-run-*/files/media/images/eval/grounding/drawings_*.png"))
    assert sorted({p.name.split("_")[1] for p in in_wandb}) == ["0", "5", "6"]  # 5: not again after the resume
    step0 = [Image.open(p).convert("RGB") for p in in_wandb if p.name.split("_")[1] == "0"]
    for path in drawn:
        picture = Image.open(path).convert("RGB")
        assert any(p.size == picture.size and not ImageChops.difference(p, picture).getbbox() for p in step0), path
    # MLflow: the same completions as a table artifact, the drawings as images
    client = _mlflow_client(run)
    artifacts = {f.path for folder in ("completions", "images") for f in client.list_artifacts(ids["mlflow"]["id"], folder)}
    assert {"completions/step-000002.json", "completions/step-000004.json", "completions/step-000006.json"} <= artifacts
    assert sum(1 for a in artifacts if a.startswith("images/eval~grounding~drawings") and a.endswith(".png")) == 3 * 2
    local = Path(client.download_artifacts(ids["mlflow"]["id"], "completions/step-000002.json", str(run.parent / "dl")))
    mlflow_table = json.loads(local.read_text())
    assert sorted(row[mlflow_table["columns"].index("thought")] for row in mlflow_table["data"]) == sorted(
        r[table["columns"].index("thought")] for r in table["data"]
    )


@pytest.mark.slow
def test_the_run_parameters_name_the_config_code_and_versions(tracked):
    run = tracked["run"]
    ids = json.loads((run / "trackers.json").read_text())
    data = _mlflow_client(run).get_run(ids["mlflow"]["id"]).data
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    assert data.params["code/git_commit"] == commit
    assert data.params["rollout.num_answers"] == "2" and data.params["train.steps"] == "5"
    assert data.params["logging.report_to"] == json.dumps(["tensorboard", "wandb", "mlflow", "swanlab", "trackio"])
    assert {"versions/torch", "versions/transformers", "versions/mlflow"} <= set(data.params)
    assert data.tags["resumed_at_3/train.steps"] == "6"  # MLflow refuses to change a parameter: the resume's value
    assert "tag/test" in data.tags


# ------------------------------------------------------------------------------ never fatal, and the config


@register_tracker
class _RaisesEverywhere(Tracker):
    name = "test-raises-everywhere"
    calls: list[str] = []

    def start(self, settings):
        self.calls.append("start")
        raise ConnectionError("no route to the tracker's server")


@register_tracker
class _RaisesAfterStart(Tracker):
    name = "test-raises-after-start"
    calls: list[str] = []

    def start(self, settings):
        self.calls.append("start")
        return "run-1"

    def log_metrics(self, step, metrics):
        self.calls.append("log_metrics")
        raise TimeoutError("the server stopped answering")

    def finish(self):
        self.calls.append("finish")
        raise TimeoutError("the server stopped answering")


def test_a_tracker_that_raises_does_not_stop_the_run(untrained_tiny_dir, tmp_path, caplog):
    from vlm_grpo_ma.run.loop import train

    run = tmp_path / "run"
    cfg = tiny_run_config(untrained_tiny_dir, run, "logging.report_to=[tensorboard,test-raises-everywhere,test-raises-after-start]",
                          "logging.rollout_every=1", "rollout.reward_workers=1", steps=2)  # fmt: skip
    with caplog.at_level("WARNING", logger="vlm_grpo_ma.trackers"):
        train(cfg)
    assert [r["step"] for r in _records(run / "metrics.jsonl")] == [1, 2]
    assert [s for s, _ in _tensorboard_scalars(run, "reward/mean")] == [1, 2]  # the working tracker got everything
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "vlm_grpo_ma.trackers"]
    assert len(warnings) == 2, warnings  # one per failing tracker, not one per call
    assert "test-raises-everywhere failed in start (ConnectionError" in warnings[0]
    assert "test-raises-after-start failed in log_metrics (TimeoutError" in warnings[1]
    assert _RaisesAfterStart.calls == ["start", "log_metrics", "finish"]  # dropped at once, finish tried once
    state = json.loads((run / "trackers.json").read_text())
    assert "test-raises-everywhere" not in state and state["tensorboard"]["last_step"] == 2


def test_an_unknown_tracker_is_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError) as error:
        check_trackers(load_config(None, ["logging.report_to=[tensorboard,wandbb]"]))
    valid = ", ".join([*TRACKERS, "none"])
    assert "logging.report_to=['tensorboard', 'wandbb']: unknown tracker(s) 'wandbb'; valid names: " + valid in str(error.value)
    assert valid.startswith("tensorboard, wandb, mlflow, swanlab, trackio")
    with pytest.raises(ConfigError, match="'none' means no tracker and cannot be listed with others"):
        check_trackers(load_config(None, ["logging.report_to=[none,tensorboard]"]))
    with pytest.raises(ConfigError, match=r"logging.tensorboard is gone: list the trackers in logging.report_to"):
        load_config(None, ["logging.tensorboard=false"])
    assert load_config(None, ["logging.report_to=[none]"]).logging.report_to == ["none"]
    with pytest.raises(ValueError, match="tracker 'wandb' is already registered"):
        register_tracker(type("Again", (Tracker,), {"name": "wandb"}))


def test_none_and_the_other_processes_open_no_tracker(tmp_path):
    # run_setup passes [] on every process but the main one: nothing is started, and the run's trackers.json
    # (the main process's) is neither read nor written
    (tmp_path / "trackers.json").write_text('{"wandb": {"id": "abc", "last_step": 3}}')
    for names in ([], ["none"]):
        trackers = open_trackers(names, tmp_path)
        trackers.log_metrics(1, {"reward/mean": 1.0})
        trackers.close()
        assert trackers.trackers == [] and trackers.state_path is None
    assert (tmp_path / "trackers.json").read_text() == '{"wandb": {"id": "abc", "last_step": 3}}'
    assert not (tmp_path / "trackers.json.tmp").exists()


def test_an_unreachable_tracker_server_does_not_stall_the_start(untrained_tiny_dir, tmp_path, monkeypatch, caplog):
    """MLflow against a server that refuses the connection retried for 249 s before the run could start.
    The start's tries are counted, with the time each may take, rather than timed (issue 45): one try, of at
    most START_TIMEOUT_S. Planted: the start without the one-try, 10-second setting (8 tries of 120 s each;
    the backoff between them set to 0 for the planted run)."""
    pytest.importorskip("mlflow", reason=EXTRA)
    import urllib3.util.connection

    from vlm_grpo_ma.run.loop import train
    from vlm_grpo_ma.run.trackers import START_TIMEOUT_S

    tries, connect = [], urllib3.util.connection.create_connection

    def counted(address, timeout, *args, **kwargs):
        tries.append((address, timeout))
        return connect(address, timeout, *args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", counted)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # loopback, a closed port
    run = tmp_path / "run"
    cfg = tiny_run_config(untrained_tiny_dir, run, "logging.report_to=[tensorboard,mlflow]", "logging.offline=false", steps=1)
    with caplog.at_level("WARNING", logger="vlm_grpo_ma.trackers"):
        train(cfg)
    assert tries == [(("127.0.0.1", 9), START_TIMEOUT_S)]
    assert "tracker mlflow failed in start" in caplog.text
    assert [s for s, _ in _tensorboard_scalars(run, "reward/mean")] == [1]  # the run went on with the others
