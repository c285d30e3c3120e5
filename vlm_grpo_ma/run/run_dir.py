"""The run directory: who may write into it (a fresh run, ``--resume``, ``--overwrite``), which checkpoint a
resume continues from, and the summary written at the end."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run.config import ConfigError
from vlm_grpo_ma.run.metrics import format_summary, read_metrics, summarize
from vlm_grpo_ma.run.trackers import TRACKER_OUTPUTS

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


def checkpoint_to_resume(run_dir: Path, resume: bool) -> tuple[Path | None, dict | None]:
    """With ``resume``: the newest checkpoint of ``run_dir`` that loads, and its training state ((None, None):
    no checkpoint, start from step 0); without: (None, None).

    A checkpoint that does not load (a ``state.pt`` or model weights cut short by a full disk or a killed
    copy) is passed over with a warning naming the file, and the one before it is tried: losing the steps
    since that one beats a run that cannot continue. When checkpoints exist but none loads, ConfigError
    naming each: starting again from step 0 would silently discard the run."""
    found = ckpt.list_checkpoints(run_dir) if resume else []
    if resume and not found:
        log.info("--resume: no checkpoint in %s, starting from step 0", run_dir)
    failures = []
    for checkpoint in reversed(found):
        try:
            state = ckpt.load_resumable_state(checkpoint)
        except ckpt.CheckpointLoadError as error:
            failures.append(str(error))
            log.warning("--resume: %s; trying the checkpoint before it", error)
            continue
        if failures:
            log.warning("--resume: continuing from %s, the newest checkpoint that loads", checkpoint)
        return checkpoint, state
    if failures:
        raise ConfigError(f"--resume: no checkpoint of {run_dir} loads: " + "; ".join(failures))
    return None, None


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
