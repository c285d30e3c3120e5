"""Experiment trackers: where a run's metrics, completions tables and held-out drawings go besides
metrics.jsonl (``logging.report_to``: tensorboard, wandb, mlflow, swanlab, trackio).

Each tracker is a small class over its library's own client, in the registry ``TRACKERS``; the loop does not
branch on them. ``open_trackers`` starts the configured ones (main process only) and returns a ``RunTrackers``,
which fans each call out and keeps the promises every tracker shares:

- **Never fatal.** A tracker that raises (at start or in any call) logs one warning naming it, the call and the
  error, and is dropped for the rest of the run; the run and its local files (metrics.jsonl, rollouts.jsonl,
  eval/) go on. KeyboardInterrupt and SystemExit are not caught.
- **Resume continues the same tracker run.** Each tracker's run id and the last step it was sent are kept in
  ``trackers.json`` in the run folder; a resumed run reopens those runs, and steps a tracker already holds
  (logged after the checkpoint the run resumes from, before a crash) are not sent again, so no step appears
  twice. TensorBoard instead replaces them (``purge_step``), as it always has.
- **Offline by default** (``logging.offline``): W&B and SwanLab in their offline modes, MLflow in a SQLite file
  of the run folder, trackio's local database in the run folder; nothing touches the network.

Why each library's client and not ``accelerate.tracking`` (which wraps all five): see docs/ARCHITECTURE.md,
"Trackers". The libraries are imported only when a run asks for them (the ``trackers`` extra installs them).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vlm_grpo_ma.run.config import Config, ConfigError

log = logging.getLogger("vlm_grpo_ma.trackers")

STATE_FILE = "trackers.json"
# What the trackers write into a run folder (run_dir.RUN_OUTPUTS: a fresh run refuses a folder holding them,
# --overwrite deletes them).
TRACKER_OUTPUTS = (STATE_FILE, "tensorboard", "wandb", "mlflow.db", "mlartifacts", "swanlog", "trackio")
NONE = "none"  # logging.report_to=[none]: metrics.jsonl only
# How long a tracker may take to start against its server: past it the tracker is dropped with a warning and
# the run goes on. An unreachable server held the start for minutes (MLflow's retries 249 s, W&B's 132 s).
START_TIMEOUT_S = 10


@dataclass
class TrackerSettings:
    """What every tracker is told at start. ``run_id``: the id this tracker's run had before a resume (None:
    a new run). ``params``: flat name -> value (resolved config, git commit, package versions)."""

    run_dir: Path
    project: str
    run_name: str
    tags: list[str] = field(default_factory=list)
    offline: bool = True
    params: dict = field(default_factory=dict)
    start_step: int = 0
    run_id: str | None = None


class Tracker:
    """One library. ``start`` opens (or reopens, when ``settings.run_id`` is set) its run and returns the run's
    id; the ``log_*`` calls take plain data: ``metrics`` finite numbers, ``rows`` the completions table (dicts
    of COMPLETION_COLUMNS, "image" a PIL image or None), ``images`` key -> [(PIL image, caption)]."""

    name = ""
    module = ""  # the importable module (checked at config time)
    replaces_resumed_steps = False  # True: the tracker itself replaces steps logged again after a resume

    def start(self, settings: TrackerSettings) -> str:
        raise NotImplementedError

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_completions(self, step: int, rows: list[dict]) -> None:
        raise NotImplementedError

    def log_images(self, step: int, images: dict[str, list]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


TRACKERS: dict[str, type[Tracker]] = {}


def register_tracker(cls: type[Tracker]) -> type[Tracker]:
    """Add a tracker class under ``cls.name``; a second class of the same name is refused."""
    if not cls.name or cls.name == NONE:
        raise ValueError(f"a tracker needs a name other than {NONE!r}; got {cls.name!r}")
    if cls.name in TRACKERS:
        raise ValueError(f"tracker {cls.name!r} is already registered ({TRACKERS[cls.name].__qualname__})")
    TRACKERS[cls.name] = cls
    return cls


def check_report_to(names: list[str]) -> None:
    """ValueError naming the problem and the valid names: an unknown name, ``none`` beside others, or a
    tracker whose library is not installed."""
    valid = [*TRACKERS, NONE]
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise ValueError(f"unknown tracker(s) {', '.join(map(repr, unknown))}; valid names: {', '.join(valid)}")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} listed more than once (every scalar would be logged twice)")
    if NONE in names and len(names) > 1:
        raise ValueError(f"{NONE!r} means no tracker and cannot be listed with others")
    missing = [n for n in names if n != NONE and TRACKERS[n].module and importlib.util.find_spec(TRACKERS[n].module) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not installed; install the trackers extra: pip install -e '.[trackers]'")


@contextlib.contextmanager
def _environment(**values: str):
    """Environment variables set for the block, then put back as they were."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_trackers(cfg: Config) -> None:
    """ConfigError for a ``logging.report_to`` no run can use (``check_report_to``), checked at the run's start
    before anything loads. The config does not check it itself: it imports no tracker."""
    try:
        check_report_to(cfg.logging.report_to)
    except ValueError as error:
        raise ConfigError(f"logging.report_to={cfg.logging.report_to}: {error}") from None


# ----------------------------------------------------------------------------------------------------------
# The fan-out


class RunTrackers:
    """The run's open trackers. Every call goes to each of them, guarded (module docstring); a step at or
    before the one a tracker held when this run started is not sent to it again."""

    def __init__(self, trackers: list[Tracker], run_dir: Path | None, state: dict):
        self.trackers = trackers
        self.state_path = None if run_dir is None else Path(run_dir) / STATE_FILE
        self.state = state  # name -> {"id": ..., "last_step": ...}
        # steps each tracker already holds from before this run started
        self.held_through = {t.name: state.get(t.name, {}).get("last_step", -1) for t in trackers}

    def _call(self, tracker: Tracker, what: str, step: int | None, call) -> None:
        if step is not None and not tracker.replaces_resumed_steps and step <= self.held_through[tracker.name]:
            return  # logged before the resume: sending it again would duplicate the step
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a tracker never stops the run
            self._drop(tracker, what, error)

    def _drop(self, tracker: Tracker, what: str, error: BaseException) -> None:
        log.warning(
            "tracker %s failed in %s (%s: %s); nothing more goes to it in this run. The run goes on, and "
            "metrics.jsonl, rollouts.jsonl and eval/ are intact.", tracker.name, what, type(error).__name__, error,
        )  # fmt: skip
        self.trackers = [t for t in self.trackers if t is not tracker]
        if what == "finish":
            return
        try:  # flush what it has, if it still can
            tracker.finish()
        except Exception:  # noqa: BLE001, S110 - already warned once
            pass

    def log_metrics(self, step: int, metrics: dict) -> None:
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for tracker in list(self.trackers):
            self._call(tracker, "log_metrics", step, lambda t=tracker: t.log_metrics(step, finite))
            if tracker in self.trackers:
                self.state.setdefault(tracker.name, {})["last_step"] = max(step, self.state[tracker.name].get("last_step", -1))
        self._save_state()

    def log_completions(self, step: int, rows: list[dict]) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "log_completions", step, lambda t=tracker: t.log_completions(step, rows))

    def log_images(self, step: int, images: dict[str, list]) -> None:
        if any(images.values()):
            for tracker in list(self.trackers):
                self._call(tracker, "log_images", step, lambda t=tracker: t.log_images(step, images))

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, "finish", None, tracker.finish)
        self.trackers = []

    def _save_state(self) -> None:
        if self.state_path is None or not self.state:
            return
        tmp = self.state_path.with_name(STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_path)


def open_trackers(names: list[str], run_dir: Path, *, project: str = "vlm-grpo-ma", run_name: str | None = None,
                  tags: list[str] = (), offline: bool = True, params: dict | None = None, start_step: int = 0) -> RunTrackers:  # fmt: skip
    """Start the trackers ``names`` for the run in ``run_dir`` (reopening the runs ``trackers.json`` names).
    A tracker that fails to start logs one warning and is left out. Call on the main process only."""
    if all(name == NONE for name in names):  # the other processes, too: they neither read nor write trackers.json
        return RunTrackers([], None, {})
    run_dir = Path(run_dir)
    state_path = run_dir / STATE_FILE
    state = {}
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
            if not isinstance(state, dict):
                raise ValueError(f"a {type(state).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as error:  # cut short by a crash, or edited by hand
            log.warning("%s does not read (%s); the trackers start new runs instead of continuing theirs", state_path, error)
            state = {}
    opened = []
    for name in names:
        if name == NONE:
            continue
        tracker = TRACKERS[name]()
        settings = TrackerSettings(
            run_dir=run_dir, project=project, run_name=run_name or run_dir.resolve().name, tags=list(tags),
            offline=offline, params=dict(params or {}), start_step=start_step, run_id=state.get(name, {}).get("id"),
        )  # fmt: skip
        try:
            run_id = tracker.start(settings)
        except Exception as error:  # noqa: BLE001 - a tracker never stops the run
            RunTrackers([tracker], None, {})._drop(tracker, "start", error)
            continue
        state.setdefault(name, {"last_step": -1})["id"] = run_id
        opened.append(tracker)
    trackers = RunTrackers(opened, run_dir, state)
    trackers._save_state()
    return trackers


# ----------------------------------------------------------------------------------------------------------
# What the loop hands over: parameters, completions rows, drawings


def run_params(config: dict) -> dict:
    """The run's parameters: the resolved config flattened to dotted keys (lists as JSON), the git commit of
    the code (``code/git_commit``, ``code/git_dirty``) and the versions of the packages that shape a run."""
    params = {}

    def flatten(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            params[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else value

    flatten("", config)
    params.update(code_version())
    for package in ("vlm-grpo-ma", "torch", "transformers", "accelerate", "peft", "wandb", "mlflow", "swanlab", "trackio"):
        try:
            params[f"versions/{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return params


def code_version() -> dict:
    """The commit of the checkout this package runs from (and whether it has uncommitted changes); "unknown"
    outside a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"code/git_commit": "unknown"}
    if commit.returncode != 0:
        return {"code/git_commit": "unknown"}
    return {"code/git_commit": commit.stdout.strip(), "code/git_dirty": bool(status.stdout.strip())}


COMPLETION_COLUMNS = ("step", "sample_id", "task", "prompt", "image", "thought", "thought_advantage", "answers", "rewards")


def completion_rows(records: list[dict], images: list) -> list[dict]:
    """One row per thought of the rollouts.jsonl ``records`` (step_metrics.rollout_records): its prompt, the
    prompt's first image (``images[i]``: a path, a PIL image or None; unreadable -> None), the thought, its
    advantage, and its M answers with their rewards."""
    from vlm_grpo_ma.model.prompts import open_image
    from vlm_grpo_ma.task_api.images import ImageLoadError

    rows = []
    for record, image in zip(records, images, strict=True):
        try:
            picture = open_image(image) if image is not None else None
        except ImageLoadError:
            picture = None
        for thought in record["thoughts"]:
            rewards = [answer["reward"] for answer in thought["answers"]]
            rows.append({
                "step": record["step"], "sample_id": record["sample_id"], "task": record["task"],
                "prompt": record["question"], "image": picture, "thought": thought["thought"],
                "thought_advantage": _one_type(thought.get("thought_advantage")),
                "answers": "\n".join(f"[{m}] reward {a['reward']:.3f}: {a['answer']}" for m, a in enumerate(thought["answers"])),
                "rewards": json.dumps(rewards),
            })  # fmt: skip
    return rows


def _one_type(advantage):
    """A per-answer thought advantage (a list: estimators whose thought advantage is [B, K, M]) as JSON text,
    like the rewards column: the tables hold numbers and text only, which every tracker's table takes."""
    return json.dumps(advantage) if isinstance(advantage, list) else advantage


def table_data(rows: list[dict], make_image) -> list[list]:
    """The rows as a list of COMPLETION_COLUMNS values, the image wrapped by the library's ``make_image``."""
    return [[(make_image(r[c]) if r[c] is not None else None) if c == "image" else r[c] for c in COMPLETION_COLUMNS] for r in rows]


def completions_text(rows: list[dict]) -> str:
    """The completions table as Markdown text, for trackers without tables."""
    lines = ["| sample | prompt | thought | thought advantage | answers (reward) |", "|---|---|---|---|---|"]
    for row in rows:
        cells = [row["sample_id"], row["prompt"], row["thought"], f"{row['thought_advantage']}", row["answers"]]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", "<br>") for c in cells) + " |")
    return "\n".join(lines)


def drawings_in(folder: Path) -> dict[str, list]:
    """The held-out drawings under ``folder`` (``<task>/*.png``, written by evaluate.draw_predictions), as
    ``eval/<task>/drawings`` -> [(PIL image, caption: the file's name)]."""
    from PIL import Image

    images: dict[str, list] = {}
    for task_folder in sorted(p for p in Path(folder).glob("*") if p.is_dir()):
        pictures = []
        for path in sorted(task_folder.glob("*.png")):
            with Image.open(path) as picture:
                pictures.append((picture.convert("RGB"), path.stem))
        images[f"eval/{task_folder.name}/drawings"] = pictures
    return images


# ----------------------------------------------------------------------------------------------------------
# The trackers


@register_tracker
class TensorBoardTracker(Tracker):
    """torch's SummaryWriter in ``tensorboard/``: scalars, completions as text, drawings as images."""

    name, module, replaces_resumed_steps = "tensorboard", "tensorboard", True

    def start(self, settings: TrackerSettings) -> str:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the earlier events of the steps a resumed run logs again
        purge_step = settings.start_step + 1 if settings.start_step else 0
        self.writer = SummaryWriter(str(settings.run_dir / "tensorboard"), purge_step=purge_step)
        if not settings.start_step:
            params = "\n".join(f"| {k} | {v} |" for k, v in settings.params.items())
            self.writer.add_text("params", "| parameter | value |\n|---|---|\n" + params, 0)
        return "tensorboard"

    def log_metrics(self, step, metrics):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_completions(self, step, rows):
        self.writer.add_text("completions", completions_text(rows), step)

    def log_images(self, step, images):
        import numpy as np

        for key, pictures in images.items():
            for picture, caption in pictures:
                self.writer.add_image(f"{key}/{caption}", np.asarray(picture), step, dataformats="HWC")

    def finish(self):
        self.writer.close()


@register_tracker
class WandbTracker(Tracker):
    """Weights & Biases: ``wandb/`` in the run folder (offline: ``wandb/offline-run-*``, ``wandb sync`` uploads
    them later). Completions as a wandb.Table with the prompt image, drawings as wandb.Image lists."""

    name = module = "wandb"

    def start(self, settings: TrackerSettings) -> str:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project, name=settings.run_name, tags=settings.tags or None, config=settings.params,
            dir=str(settings.run_dir), id=settings.run_id, resume="allow" if settings.run_id else None,
            mode="offline" if settings.offline else None,
            # console="off": wandb would otherwise wrap sys.stdout/err; the progress bar and logs stay ours
            settings=wandb.Settings(console="off", silent=True, init_timeout=START_TIMEOUT_S),
            reinit="create_new",
        )  # fmt: skip
        if settings.run_id:  # resumed: the config may differ (train.steps ...); W&B keeps the newest values
            self.run.config.update(settings.params, allow_val_change=True)
        return self.run.id

    def log_metrics(self, step, metrics):
        self.run.log(metrics, step=step)

    def log_completions(self, step, rows):
        data = table_data(rows, self.wandb.Image)
        self.run.log({"completions": self.wandb.Table(columns=list(COMPLETION_COLUMNS), data=data)}, step=step)

    def log_images(self, step, images):
        self.run.log({k: [self.wandb.Image(p, caption=c) for p, c in v] for k, v in images.items() if v}, step=step)

    def finish(self):
        self.run.finish()


@register_tracker
class MlflowTracker(Tracker):
    """MLflow through an explicit ``MlflowClient`` (no fluent global run, which would clash with a user's own
    ``mlflow.start_run``). Offline: ``sqlite:///<run>/mlflow.db``, artifacts in ``mlartifacts/`` (the file
    store is refused by MLflow 3 unless MLFLOW_ALLOW_FILE_STORE is set). Completions as a table artifact
    ``completions/step-NNNNNN.json`` (text; MLflow tables hold no images), drawings by ``log_image``."""

    name = module = "mlflow"

    def start(self, settings: TrackerSettings) -> str:
        from mlflow import MlflowClient

        uri = f"sqlite:///{settings.run_dir.resolve() / 'mlflow.db'}" if settings.offline else None
        self.client = client = MlflowClient(tracking_uri=uri)
        with _environment(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(START_TIMEOUT_S)):
            return self._start(client, settings)

    def _start(self, client, settings: TrackerSettings) -> str:
        """The run to log to, opened or reopened: one try per request, within START_TIMEOUT_S, at the start."""
        if settings.run_id:
            self.run_id = settings.run_id
            client.update_run(self.run_id, status="RUNNING")
            self._log_params(settings.params, resumed_at=settings.start_step)
            return self.run_id
        experiment = client.get_experiment_by_name(settings.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (settings.run_dir.resolve() / "mlartifacts").as_uri() if settings.offline else None
            experiment_id = client.create_experiment(settings.project, artifact_location=artifacts)
        tags = {f"tag/{t}": "" for t in settings.tags}
        self.run_id = client.create_run(experiment_id, run_name=settings.run_name, tags=tags).info.run_id
        self._log_params(settings.params)
        return self.run_id

    def _log_params(self, params: dict, resumed_at: int | None = None) -> None:
        """MLflow refuses to change a logged parameter, and a resume may change some (train.steps): those go to
        tags ``resumed_at_<step>/<name>``; unchanged ones are not sent again."""
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params if resumed_at is not None else {}
        values = {k: str(v)[:6000] for k, v in params.items()}  # MLflow's limit on a parameter's length
        new = [Param(k, v) for k, v in values.items() if k not in logged]
        changed = [RunTag(f"resumed_at_{resumed_at}/{k}", v) for k, v in values.items() if k in logged and logged[k] != v]
        for i in range(0, max(len(new), len(changed)), 100):  # at most 100 per batch
            self.client.log_batch(self.run_id, params=new[i : i + 100], tags=changed[i : i + 100])

    def log_metrics(self, step, metrics):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_completions(self, step, rows):
        columns = [c for c in COMPLETION_COLUMNS if c != "image"]
        self.client.log_table(self.run_id, {c: [r[c] for r in rows] for c in columns}, f"completions/step-{step:06d}.json")

    def log_images(self, step, images):
        for key, pictures in images.items():
            for picture, caption in pictures:
                self.client.log_image(self.run_id, picture, key=f"{key}/{caption}", step=step)

    def finish(self):
        self.client.set_terminated(self.run_id)


@register_tracker
class SwanlabTracker(Tracker):
    """SwanLab: ``swanlog/run-*`` in the run folder (offline mode; ``swanlab sync`` uploads later). SwanLab has
    no table type: the completions go as Markdown text plus the prompt images; drawings as swanlab.Image."""

    name = module = "swanlab"

    def start(self, settings: TrackerSettings) -> str:
        import swanlab

        self.swanlab = swanlab
        resume = {"id": settings.run_id, "resume": "allow"} if settings.run_id else {}
        self.run = swanlab.init(
            project=settings.project, experiment_name=settings.run_name, tags=settings.tags or None,
            config=settings.params, logdir=str(settings.run_dir / "swanlog"),
            mode="offline" if settings.offline else None, **resume,
        )  # fmt: skip
        return self.run.id

    def log_metrics(self, step, metrics):
        self.run.log(metrics, step=step)

    def log_completions(self, step, rows):
        values = {"completions": self.swanlab.Text(completions_text(rows))}
        prompts = {r["sample_id"]: r for r in rows if r["image"] is not None}  # one image per prompt
        if prompts:
            values["completions/images"] = [self.swanlab.Image(r["image"], caption=f"{i}: {r['prompt']}") for i, r in prompts.items()]
        self.run.log(values, step=step)

    def log_images(self, step, images):
        self.run.log({k: [self.swanlab.Image(p, caption=c) for p, c in v] for k, v in images.items() if v}, step=step)

    def finish(self):
        self.run.finish()


@register_tracker
class TrackioTracker(Tracker):
    """trackio, local: its SQLite database and media live in TRACKIO_DIR, which trackio reads once at import;
    when it is unset (and trackio not yet imported) it is set to ``<run>/trackio``. A run is resumed by name."""

    name = module = "trackio"

    def start(self, settings: TrackerSettings) -> str:
        if settings.offline and "TRACKIO_DIR" not in os.environ and "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = str(settings.run_dir.resolve() / "trackio")
        import trackio

        self.trackio = trackio
        name = settings.run_id or settings.run_name
        self.run = trackio.init(
            project=settings.project, name=name, config=settings.params, resume="allow" if settings.run_id else "never",
            embed=False, auto_log_gpu=False, auto_log_cpu=False, space_id=None if settings.offline else os.environ.get("TRACKIO_SPACE_ID"),
        )  # fmt: skip
        return self.run.name

    def log_metrics(self, step, metrics):
        self.run.log(metrics, step=step)

    def log_completions(self, step, rows):
        data = table_data(rows, self.trackio.Image)
        self.run.log({"completions": self.trackio.Table(columns=list(COMPLETION_COLUMNS), data=data)}, step=step)

    def log_images(self, step, images):
        self.run.log({f"{k}/{i}": self.trackio.Image(p, caption=c) for k, v in images.items() for i, (p, c) in enumerate(v)}, step=step)

    def finish(self):
        self.run.finish()
