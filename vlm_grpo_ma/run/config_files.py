"""The config's files: a YAML config file read (``config_file_values``), dotted command-line overrides
(``parse_override``), both merged over the defaults into a validated ``Config`` (``load_config``), and a run's
``config.yaml`` written atomically (``save_config``) and checked for completeness on resume (``missing_settings``),
and the whole tree with what each setting is (``describe_config``: ``--print-config``). The typed tree itself and
its validation are ``run/config.py``."""

from __future__ import annotations

import ast
import dataclasses
import io
import math
import os
import tokenize
from pathlib import Path
from typing import Any

import yaml

from vlm_grpo_ma.run import config as config_module
from vlm_grpo_ma.run.config import Config, ConfigError, merge, validate


def parse_override(text: str) -> dict[str, Any]:
    """``rollout.num_answers=8`` -> {"rollout": {"num_answers": 8}} (values parsed as YAML scalars)."""
    parts, value = _override_path(text)
    nested: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[1:-1]):
        nested = {part: nested}
    return {parts[0]: nested}


def _override_path(text: str) -> tuple[list[str], Any]:
    """``data.tasks.vqa=2`` -> (["data", "tasks", "vqa"], 2): where the override puts its value, and the value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. rollout.num_answers=8)")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) < 2:
        raise ConfigError(f"override key {dotted!r} must be section.key (e.g. rollout.num_answers)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: the value {raw!r} is not valid YAML ({_yaml_problem(error)})") from None
    return parts, value


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's short reason ("found unexpected end of stream"), without its multi-line snippet."""
    return getattr(error, "problem", None) or str(error).splitlines()[0]


def _put(values: dict, parts: list[str], value: Any) -> None:
    """``value`` at the dotted place ``parts`` of ``values``, replacing what was there, a mapping too: a setting
    given whole (``data.tasks={vqa: 1}``, or in a file) replaces the one before, so an entry can be removed, while
    ``data.tasks.vqa=1`` sets one entry. A place under something that is not a mapping (``train: 5``, then
    ``train.steps=9``) is a ConfigError: replacing it would hide the malformed section."""
    for depth, key in enumerate(parts[:-1]):
        if values.get(key) is None:
            values[key] = {}
        elif not isinstance(values[key], dict):
            raise ConfigError(f"config section {'.'.join(parts[: depth + 1])!r} must be a mapping, got {values[key]!r}")
        values = values[key]
    values[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {key!r} is given twice (first on line {seen[key]}); give it once"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def config_file_values(path: str | Path) -> dict[str, Any]:
    """The sections of a YAML config file, unvalidated; ConfigError naming the file (and line) when it is
    missing, not YAML, not UTF-8 or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({_yaml_problem(error)})") from None
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return values


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, base: str | Path | None = None) -> Config:
    """The defaults, then ``base`` (a resumed run's own config.yaml), then the file ``path``, then the dotted
    ``overrides``, each over the one before; validated."""
    values: dict[str, Any] = {}
    for file in (base, path):
        if file is not None:
            for section, settings in config_file_values(file).items():  # section by section, setting by setting
                for key, value in settings.items() if isinstance(settings, dict) else [(None, settings)]:
                    _put(values, [section] if key is None else [section, key], value)
    for text in overrides or []:
        _put(values, *_override_path(text))
    return validate(merge(Config(), values))


def save_config(cfg: Config, path: Path, *, history: list[str] = ()) -> None:
    """``cfg`` as YAML, after ``history`` as comment lines (what each resume changed, and when); written
    atomically, since a resume continues with it (``missing_settings``)."""
    comments = "".join(f"# {line}\n" for line in history)
    write_atomically(path, comments + yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# Sections added after runs were saved whose defaults are what those runs did (no judge): a saved config without
# one resumes with its defaults.
SECTIONS_ADDED_LATER = ("judge",)


def missing_settings(values: dict[str, Any]) -> list[str]:
    """What a config file's ``values`` (``config_file_values``) lack of what ``save_config`` writes: every section
    and key, named (whole sections first, as ``section.*``). A saved run's config.yaml must hold them all, or the
    defaults would fill in and a resume would continue another run."""
    sections, keys = [], []
    for section in dataclasses.fields(Config):
        given = values.get(section.name)
        if given is None and section.name in SECTIONS_ADDED_LATER:
            continue
        if not isinstance(given, dict):
            sections.append(f"{section.name}.*")
            continue
        keys += [f"{section.name}.{item.name}" for item in dataclasses.fields(section.default_factory) if item.name not in given]
    return sections + keys


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it, renamed over it once written and synced: a crash
    mid-write leaves the old file or the new one, never one cut short."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def setting_descriptions() -> dict[str, str]:
    """``{"section.key": what it is}`` for every setting: the comments that document its field in run/config.py
    (the comment lines right above it, then the comment on its own lines), joined into one line. Those comments
    are the one place a setting is described; ``--print-config`` shows them, and a test holds every setting to
    having one."""
    source = Path(config_module.__file__).read_text(encoding="utf-8")
    comments: dict[int, str] = {}  # line number -> comment text
    comment_lines: set[int] = set()  # the lines that hold nothing but a comment
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
            if token.line.lstrip().startswith("#"):
                comment_lines.add(token.start[0])
    classes = {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}
    descriptions = {}
    for section in dataclasses.fields(Config):
        for statement in classes[section.default_factory.__name__].body:
            if not isinstance(statement, ast.AnnAssign):
                continue
            above, line = [], statement.lineno - 1
            while line in comment_lines:
                above.insert(0, comments[line])
                line -= 1
            own = [comments[n] for n in range(statement.lineno, statement.end_lineno + 1) if n in comments]
            descriptions[f"{section.name}.{statement.target.id}"] = " ".join(above + own)
    return descriptions


def describe_config(cfg: Config) -> str:
    """``cfg`` as a YAML file ``--config`` reads, each setting on one line with what it is as its comment
    (``setting_descriptions``)."""
    descriptions = setting_descriptions()
    lines = ["# every setting (section.key=value on the command line), and what it is: the comments in run/config.py"]
    for section, values in cfg.to_dict().items():
        lines.append(f"{section}:")
        for key, value in values.items():
            shown = yaml.safe_dump(value, default_flow_style=True, width=math.inf).splitlines()[0]
            lines.append(f"  {f'{key}: {shown}':<44}  # {descriptions[f'{section}.{key}']}")
    return "\n".join(lines)
