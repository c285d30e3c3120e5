"""The run's served judge (``judge.*`` settings), built and checked at start: for the tasks whose rewards ask one
(``Task.judge_query``), a ``task_api.judge.Judge`` with its verdict cache in the run (or evaluation) folder."""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from vlm_grpo_ma.run.config import ConfigError, JudgeConfig
from vlm_grpo_ma.task_api.judge import Judge, JudgeUnavailable
from vlm_grpo_ma.task_api.registry import Task

log = logging.getLogger(__name__)

CACHE_FILE = "judge_cache.sqlite"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URL_UNSENDABLE = re.compile(r"[\x00-\x20\x7f]")  # what http.client refuses in a URL (a space, a control character)
_KEY = re.compile(r"[\x21-\x7e]+")  # what a Bearer token can be: visible ASCII, no space or line break


def judge_for(settings: JudgeConfig, tasks: Iterable[Task], folder: Path, *, probe: bool = True) -> Judge | None:
    """The judge the tasks need, or None when none asks one. ConfigError, in one line, for settings that cannot
    work: no ``judge.base_url`` or ``judge.model``, a URL that is not http(s) (``check_base_url``), an API key
    variable that is unset or not a variable name or a key a header cannot carry, a verdict cache file that is
    not a database, a server that refuses the key, redirects or does not serve the model. A server that cannot be
    reached is not refused: it is warned about once, and its answers score 0, counted (``judge_failures``)."""
    needing = sorted(task.name for task in tasks if task.judge_query is not None)
    if not needing:
        return None
    who = f"task{'s' * (len(needing) > 1)} {', '.join(needing)} score{'s' * (len(needing) == 1)} answers with a served judge"
    if not settings.base_url or not settings.model:
        raise ConfigError(f"{who}: set judge.base_url (an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1)"
                          " and judge.model (the served model's name); docs/JUDGE.md says how to serve one")  # fmt: skip
    check_base_url(settings.base_url)
    api_key = None
    if settings.api_key_env:
        if not _ENV_NAME.fullmatch(settings.api_key_env):  # not echoed: it may be the key itself
            raise ConfigError("judge.api_key_env must name an environment variable (letters, digits and _), not hold the"
                              " key; export the key as, say, JUDGE_API_KEY and set judge.api_key_env=JUDGE_API_KEY")  # fmt: skip
        api_key = os.environ.get(settings.api_key_env)
        if not api_key:
            raise ConfigError(f"judge.api_key_env={settings.api_key_env}: the environment variable {settings.api_key_env} is not set")
        if not _KEY.fullmatch(api_key):  # not echoed; urllib would quote it whole in its error
            raise ConfigError(f"judge.api_key_env={settings.api_key_env}: the key in {settings.api_key_env} holds a space, a line"
                              " break or another character an HTTP header cannot carry (a key file saved with a line end?)")  # fmt: skip
    try:
        judge = Judge(
            base_url=settings.base_url, model=settings.model, api_key=api_key, verdict_format=settings.verdict,
            max_in_flight=settings.max_in_flight, request_timeout_s=settings.request_timeout_s, retries=settings.retries,
            max_answer_chars=settings.max_answer_chars, max_tokens=settings.max_tokens, send_images=settings.send_images,
            constrain_verdict=settings.constrain_verdict, cache_path=folder / CACHE_FILE,
        )  # fmt: skip
    except sqlite3.Error as error:  # it holds only verdicts the judge can give again
        raise ConfigError(f"the judge's verdict cache {folder / CACHE_FILE} cannot be used ({error}); delete it") from None
    if probe:
        try:
            check_served(judge)
        except ConfigError:
            judge.close()
            raise
    return judge


def check_base_url(base_url: str) -> None:
    """ConfigError unless ``base_url`` is an http(s) URL that urllib can send requests to, with the endpoint's
    paths under it: no query or fragment (``/models`` and ``/chat/completions`` are appended) and no credentials
    (the key goes in judge.api_key_env; a URL is written to the config and the logs)."""
    try:
        url = urllib.parse.urlsplit(base_url)
        url.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        url = None
    if url is not None and (url.query or url.fragment or url.username is not None):  # not echoed: it may hold a key
        raise ConfigError("judge.base_url holds a query (?...), a fragment (#...) or credentials (user:key@); give the endpoint"
                          " alone (e.g. http://127.0.0.1:8000/v1) and the key in an environment variable named by judge.api_key_env")  # fmt: skip
    if url is None or url.scheme not in ("http", "https") or not url.hostname or _URL_UNSENDABLE.search(base_url):
        raise ConfigError(f"judge.base_url={base_url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000/v1)")


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
