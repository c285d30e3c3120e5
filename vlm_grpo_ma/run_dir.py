"""The run directory: who may write into it (a fresh run, ``--resume``, ``--overwrite``), which checkpoint a
resume continues from, and the summary written at the end."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

from vlm_grpo_ma import checkpoint as ckpt
from vlm_grpo_ma.config import ConfigError
from vlm_grpo_ma.metrics import format_summary, read_metrics, summarize
from vlm_grpo_ma.trackers import TRACKER_OUTPUTS

log = logging.getLogger("vlm_grpo_ma.train")


RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "rollouts.jsonl", "summary.json", "eval", "config.yaml", *TRACKER_OUTPUTS)


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, delete: bool = True) -> None:
    """A fresh run must not append to another run's metrics or leave its checkpoints behind (the newest would
    be picked up by --resume and by evaluation): refuse a directory that holds a run, unless ``resume``
    continues it or ``overwrite`` deletes its outputs first (``delete``: this process is the one that does).
    Every process checks, so all of them stop on the same error."""
    if resume:
        return
    found = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"train.output_dir={run_dir} already holds a run ({', '.join(found)}); continue it with --resume, "
            "start over with --overwrite (deletes those outputs), or choose another --output-dir"
        )
    if not delete:  # another process of the same run deletes them
        return
    for name in found:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    log.info("--overwrite: deleted %s from %s", ", ".join(found), run_dir)


def checkpoint_to_resume(run_dir: Path, resume: bool) -> Path | None:
    """The newest checkpoint of ``run_dir`` with ``resume`` (None: start from step 0), else None."""
    last = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume and last is None:
        log.info("--resume: no checkpoint in %s, starting from step 0", run_dir)
    return last


def write_summary(run_dir: Path, headline: list[str], counters: dict, *, is_main: bool) -> dict:
    """The run's summary (``headline`` metrics over the run, and the counters): summary.json and stdout on
    the main process; returned on every process."""
    summary = summarize(read_metrics(run_dir), keys=tuple(dict.fromkeys(headline)))
    summary["counters"] = dict(counters)
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2))
        print(format_summary(summary), flush=True)
        print(f"run directory: {run_dir}", flush=True)
    return summary


def _json_safe(value):
    """NaN (e.g. a noise estimate from a single step) becomes null: summary.json stays strict JSON."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
