"""The run directory: the lock one run holds on it for its life, who may write into it (a fresh run,
``--resume``, ``--overwrite``), the settings and the checkpoint a resume continues from, and the summary
written at the end."""

from __future__ import annotations

import datetime
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

from vlm_grpo_ma.run import checkpoint as ckpt
from vlm_grpo_ma.run.config import (
    CARRIED_AS_SAVED,
    CHECKPOINT_STATE,
    Config,
    ConfigError,
    checkpoint_state_keys,
)
from vlm_grpo_ma.run.config_files import config_file_values, load_config, missing_settings, write_atomically
from vlm_grpo_ma.run.metrics import format_summary, read_metrics, summarize
from vlm_grpo_ma.run.trackers import TRACKER_OUTPUTS

log = logging.getLogger("vlm_grpo_ma.train")


CONFIG_FILE = "config.yaml"
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "rollouts.jsonl", "summary.json", "eval", CONFIG_FILE, *TRACKER_OUTPUTS)


LOCK_FILE = ".run.lock"  # held (flock) by the run that writes the folder, for its whole life


def outputs_in(run_dir: Path) -> list[str]:
    """The run outputs (``RUN_OUTPUTS``) that ``run_dir`` holds."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def folder_refused(run_dir: Path, what: str, error: OSError) -> ConfigError:
    """The one line for a run folder the operating system refuses (not writable, a name too long, under /proc
    ...): the folder, what the run was doing, and the OS's reason."""
    return ConfigError(f"train.output_dir={run_dir}: cannot {what} ({error.strerror or error}); choose another --output-dir")


def hold_run_dir(run_dir: Path):
    """An exclusive lock on the run folder, held until the returned file is closed or the process ends (the
    operating system releases it however the process ends: no stale lock after a crash). Another process
    holding it is a ConfigError naming it (pid, host, start, command): two runs would interleave their
    metrics and overwrite each other's checkpoints, and ``--overwrite`` would delete a live run's outputs."""
    import fcntl
    import os
    import socket
    import stat
    import sys

    lock = run_dir / LOCK_FILE
    if lock.is_symlink():  # writing the lock would overwrite the link's target
        raise ConfigError(
            f"train.output_dir={run_dir}: its {LOCK_FILE} is a symbolic link (to {os.readlink(lock)}), and a run writes"
            " its lock; remove the link, or choose another --output-dir"
        )
    try:  # O_NOFOLLOW: a link made since the check above fails here rather than being followed
        descriptor = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    except OSError as error:  # a folder named .run.lock, a read-only folder or disk
        raise ConfigError(
            f"train.output_dir={run_dir}: cannot write its lock {lock} ({error.strerror}); a run needs a folder it"
            f" can write and {LOCK_FILE} a plain file in it: fix that, or choose another --output-dir"
        ) from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # a FIFO or a device: no file to lock, seek and write
        os.close(descriptor)
        raise ConfigError(
            f"train.output_dir={run_dir}: its {LOCK_FILE} is not a plain file (a FIFO or a device), and a run writes"
            " its lock there; remove it, or choose another --output-dir"
        )
    handle = os.fdopen(descriptor, "a+", encoding="utf-8")  # noqa: SIM115 - held for the run's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that wrote nothing"
        handle.close()
        raise ConfigError(
            f"train.output_dir={run_dir} is in use by another run ({holder}); wait for it to end, stop it, or "
            "choose another --output-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}: {' '.join(sys.argv)}\n")
    handle.flush()
    return handle


def check_shared_folder(run_dir: Path, main_stamp: str) -> None:
    """ConfigError unless this process sees the lock the main process wrote in ``run_dir`` (``main_stamp``, its
    text): the processes of a launch, on every machine, must share one folder, or each would choose its own
    checkpoint to resume from and whether to save on the way out, and they would drift or hang."""
    lock = run_dir / LOCK_FILE
    seen = lock.read_text(encoding="utf-8").strip() if lock.is_file() else ""
    if seen != main_stamp.strip():
        raise ConfigError(
            f"train.output_dir={run_dir} is not the folder the main process writes (its lock says {main_stamp.strip()!r};"
            f" this process sees {seen or 'no lock'!r}): every process of a launch, on every machine, must see one"
            " shared folder"
        )


def check_resumable(run_dir: Path) -> None:
    """Before a resume writes anything (its lock included): refuse a folder that holds outputs but no
    config.yaml. No run of this trainer wrote it (each writes its config first), and resuming would empty its
    metrics.jsonl and write a config over its own."""
    found = outputs_in(run_dir)
    if found and not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(
            f"--resume: {run_dir} holds {', '.join(found)} but no {CONFIG_FILE} of a run of this trainer, so there is"
            " no run to continue; nothing in it was changed. Choose another --output-dir"
        )


def claim_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, delete: bool = True) -> None:
    """A fresh run must not append to another run's metrics or leave its checkpoints behind (the newest would
    be picked up by --resume and by evaluation): refuse a directory that holds a run, unless ``resume``
    continues it or ``overwrite`` deletes its outputs first (``delete``: this process is the one that does).
    Every process checks, so all of them stop on the same error."""
    if resume:
        return
    found = outputs_in(run_dir)
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


def flat_settings(cfg: Config) -> dict[str, Any]:
    """``{"section.key": value}`` of every setting."""
    return {f"{section}.{key}": value for section, values in cfg.to_dict().items() for key, value in values.items()}


def changed_settings(before: Config, after: Config) -> dict[str, tuple[Any, Any]]:
    """``{"section.key": (before, after)}`` of the settings that differ."""
    old, new = flat_settings(before), flat_settings(after)
    return {key: (old[key], new[key]) for key in old if old[key] != new[key]}


def resumed_settings(cfg: Config, config_file: str | None, overrides: list[str], *, allow_changes: bool) -> Config:
    """The settings a ``--resume`` continues with: the run's own ``config.yaml`` (which must hold every setting:
    ``check_saved_config``), then what the command line names (``config_file`` and ``overrides``) over it;
    ``cfg`` (the command line over the defaults) only says which folder, and is returned as it is when that
    folder holds no saved run. A change to a setting that shapes the checkpoint (``config.checkpoint_state_keys``)
    is refused, naming it, unless ``allow_changes``; one to a part that the resume takes from the checkpoint as
    saved (``config.CARRIED_AS_SAVED``: it could not take effect) is refused even then, if a checkpoint exists."""
    run_dir = Path(cfg.train.output_dir)
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        return cfg
    try:
        before = read_saved_config(saved)
        after = load_config(config_file, [*overrides, f"train.output_dir={run_dir}"], base=saved)
    except ConfigError as error:
        raise ConfigError(f"--resume: the run's own {saved}: {error}") from None
    changed = {key: values for key, values in changed_settings(before, after).items() if key != "train.output_dir"}
    shaping = checkpoint_state_keys()
    defining = [key for key in changed if key in shaping]

    def listed(keys: list[str]) -> str:
        return "; ".join(
            f"{key}={changed[key][1]!r} (the run has {changed[key][0]!r}), which shapes {CHECKPOINT_STATE[shaping[key]]}"
            for key in keys
        )

    kept = [key for key in defining if shaping[key] in CARRIED_AS_SAVED]
    if kept and ckpt.list_checkpoints(run_dir):
        raise ConfigError(
            f"--resume cannot change {listed(kept)}: a resume continues from what its checkpoint holds, as saved, so"
            " the change could not take effect. Resume without changing it, or start a new run in another --output-dir"
        )
    if defining and not allow_changes:
        raise ConfigError(
            f"--resume continues the run in {run_dir} with its own settings, and this command changes what the run is: "
            f"{listed(defining)}. Resume without changing it, start a new run in another --output-dir, or add --allow-changes "
            "to change it anyway (recorded in config.yaml)"
        )
    return after


def read_saved_config(saved: Path) -> Config:
    """A saved run's settings: its ``config.yaml`` validated, then checked whole (``check_saved_config``);
    ConfigError otherwise. How ``--resume`` and ``evaluate`` read a run's own settings."""
    config = load_config(saved)  # first: a key no run of this trainer writes says whose file it is
    check_saved_config(saved)
    return config


def check_saved_config(saved: Path) -> None:
    """ConfigError unless the saved run's ``config.yaml`` holds every setting ``save_config`` writes: one left
    empty or cut short by a crash (or edited) would have the defaults fill in, and a K=2, M=2 run would go on
    at 4 x 4 with 16 prompts."""
    values = config_file_values(saved)
    if not values:
        raise ConfigError(
            f"{CONFIG_FILE} is empty (cut short?), so the run's settings are unknown: write them back into it, or start"
            " a new run in another --output-dir"
        )
    missing = missing_settings(values)
    if missing:
        named = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError(
            f"{CONFIG_FILE} lacks {named} (cut short, or edited), so the run's settings are unknown and the"
            " defaults would continue another run: write the run's values back into it, or start a new run in"
            " another --output-dir"
        )


def resume_history(run_dir: Path, cfg: Config, start_step: int) -> list[str]:
    """The comment lines of the run's ``config.yaml`` (one per resume) with this resume's line added: the UTC
    time, the step it continues from, and each setting it changed (``key: before -> after``); logged too."""
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        return []
    lines = saved.read_text(encoding="utf-8").splitlines()
    history = [line[2:] for line in lines if line.startswith("# ")]
    try:
        before = load_config(saved)
    except ConfigError:  # resumed_settings read it; a run started from train() directly may have left anything
        before = None
    changed = {} if before is None else {k: v for k, v in changed_settings(before, cfg).items() if k != "train.output_dir"}
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    what = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items()) or "no setting changed"
    shaping = checkpoint_state_keys()
    for key in changed:
        (log.warning if key in shaping else log.info)("--resume changes %s: %r -> %r", key, *changed[key])
    return [*history, f"resumed {when} at step {start_step}: {what}"]


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
    checkpoint, state, failures = ckpt.newest_that_loads(
        found, ckpt.load_resumable_state, lambda error: log.warning("--resume: %s; trying the checkpoint before it", error)
    )
    if checkpoint is not None:
        if failures:
            log.warning("--resume: continuing from %s, the newest checkpoint that loads", checkpoint)
            for passed_over in found[found.index(checkpoint) + 1 :]:
                set_aside(passed_over)
        return checkpoint, state
    if failures:
        raise ConfigError(f"--resume: no checkpoint of {run_dir} loads: " + "; ".join(failures))
    return None, None


def set_aside(checkpoint: Path) -> Path:
    """Rename a checkpoint that does not load to ``step-N.corrupt`` (``.corrupt-2`` ... if taken), kept for a look
    but no checkpoint any more: left as ``step-N``, a stop before the next save found it the newest and took step
    N as saved already (a whole interval lost), and ``evaluate`` kept trying it first."""
    aside, n = checkpoint.with_name(checkpoint.name + ".corrupt"), 1
    while aside.exists():  # set aside before, by an earlier resume
        n += 1
        aside = checkpoint.with_name(f"{checkpoint.name}.corrupt-{n}")
    checkpoint.rename(aside)
    log.warning("--resume: moved the checkpoint that does not load to %s", aside)
    return aside


def write_summary(run_dir: Path, headline: list[str], counters: dict, *, is_main: bool) -> dict:
    """The run's summary (``headline`` metrics over the run, and the counters): summary.json and stdout on
    the main process; returned on every process."""
    summary = summarize(read_metrics(run_dir), keys=tuple(dict.fromkeys(headline)))
    summary["counters"] = dict(counters)
    if is_main:
        write_atomically(run_dir / "summary.json", json.dumps(_json_safe(summary), indent=2))  # a study reads it
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
