"""The run's served judge (``judge.*`` settings), built and checked at start: for the tasks whose rewards ask one
(``Task.judge_query``), a ``task_api.judge.Judge`` with its verdict cache in the run (or evaluation) folder."""

from __future__ import annotations

import logging
import os
import re
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from vlm_grpo_ma.run.config import ConfigError, JudgeConfig
from vlm_grpo_ma.task_api.judge import Judge, JudgeUnavailable
from vlm_grpo_ma.task_api.registry import Task

log = logging.getLogger(__name__)

CACHE_FILE = "judge_cache.sqlite"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def judge_for(settings: JudgeConfig, tasks: Iterable[Task], folder: Path, *, probe: bool = True) -> Judge | None:
    """The judge the tasks need, or None when none asks one. ConfigError, in one line, for settings that cannot
    work: no ``judge.base_url`` or ``judge.model``, a URL that is not http(s), an API key variable that is unset
    or not a variable name, a server that refuses the key or does not serve the model. A server that cannot be
    reached is not refused: it is warned about once, and its answers score 0, counted (``judge_failures``)."""
    needing = sorted(task.name for task in tasks if task.judge_query is not None)
    if not needing:
        return None
    who = f"task{'s' * (len(needing) > 1)} {', '.join(needing)} score{'s' * (len(needing) == 1)} answers with a served judge"
    if not settings.base_url or not settings.model:
        raise ConfigError(f"{who}: set judge.base_url (an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1)"
                          " and judge.model (the served model's name); docs/JUDGE.md says how to serve one")  # fmt: skip
    url = urllib.parse.urlsplit(settings.base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"judge.base_url={settings.base_url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")
    api_key = None
    if settings.api_key_env:
        if not _ENV_NAME.fullmatch(settings.api_key_env):  # not echoed: it may be the key itself
            raise ConfigError("judge.api_key_env must name an environment variable (letters, digits and _), not hold the"
                              " key; export the key as, say, JUDGE_API_KEY and set judge.api_key_env=JUDGE_API_KEY")  # fmt: skip
        api_key = os.environ.get(settings.api_key_env)
        if not api_key:
            raise ConfigError(f"judge.api_key_env={settings.api_key_env}: the environment variable {settings.api_key_env} is not set")
    judge = Judge(
        base_url=settings.base_url, model=settings.model, api_key=api_key, verdict_format=settings.verdict,
        max_in_flight=settings.max_in_flight, request_timeout_s=settings.request_timeout_s, retries=settings.retries,
        max_answer_chars=settings.max_answer_chars, max_tokens=settings.max_tokens, send_images=settings.send_images,
        constrain_verdict=settings.constrain_verdict, cache_path=folder / CACHE_FILE,
    )  # fmt: skip
    if probe:
        try:
            check_served(judge)
        except ConfigError:
            judge.close()
            raise
    return judge


def check_served(judge: Judge) -> None:
    """At start: the server lists ``judge.model``. Unreachable: warned once (the steps do not warn again)."""
    try:
        served = judge.served_models()
    except JudgeUnavailable as error:
        if error.kind == "refused":  # it answered: a wrong key, a wrong path
            raise ConfigError(f"judge.base_url={judge.base_url}: {error} (a wrong API key or path?)") from None
        judge.note_unavailable(error)
        return
    if judge.model not in served:
        raise ConfigError(f"judge.model={judge.model!r} is not served at {judge.base_url}; it serves: {', '.join(served) or 'nothing'}")
    log.info("judge %s at %s", judge.model, judge.base_url)
