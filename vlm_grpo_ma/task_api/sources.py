"""Reading a task's data: checked source files, the embedded splits, rows of JSONL, JSON, CSV, parquet and
folders (``read_rows``), schema detection, and rows to samples with their images kept as paths or bytes."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vlm_grpo_ma.task_api.images import ImageLoadError, open_lazily
from vlm_grpo_ma.task_api.registry import Sample, skip_row


class BadRow(ValueError):
    """A row a loader cannot use, said as ``f"{where}: why"`` (a blank option, an answer not in the form its
    type needs, a NUL byte in a path). Raised by a ``make_sample`` inside ``rows_to_samples``, it drops the row,
    counted under ``reason``, and the file loads without it; anywhere else it is the ValueError it is. What
    makes the whole file unreadable (a missing column, text that is not UTF-8) stays a plain ValueError."""

    def __init__(self, message: str, reason: str = "malformed_rows"):
        super().__init__(message)
        self.reason = reason


def checked_source_file(source: str, task: str, suffixes: Sequence[str], *, folders: bool = False) -> Path:
    """``source`` as a Path, after checking that its suffix is one the task reads (ValueError naming the
    valid ones; ``folders=True``: the message says a folder is valid too, for a task that has checked for one
    already) and that the file exists (FileNotFoundError)."""
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        valid = f": a folder or a file ending in {', '.join(suffixes)}" if folders else f" suffixes: {', '.join(suffixes)}"
        raise ValueError(f"unknown {task} source format {suffix or '(no suffix)'!r} for {source!r}; valid{valid}")
    if not path.is_file():
        raise FileNotFoundError(f"{task} source file not found: {path}")
    return path


def embedded_split_file(task: str, split: str, splits: Sequence[str], folder: Path, make: str) -> Path:
    """``folder/{split}.jsonl``, a task's own data file for ``split``, after checking that ``split`` is one of
    ``splits`` (ValueError naming them) and that the file exists (FileNotFoundError saying to run ``make``, the
    command that generates it)."""
    if split not in splits:
        raise ValueError(f"unknown {task} split {split!r}; embedded splits: {', '.join(splits)}")
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"embedded {task} split missing: {path}; run `{make}`")
    return path


def require_keys(row: dict, keys: Sequence[str], where: str) -> None:
    """Raise ValueError naming ``where``, the missing keys and all required keys (or what the row is, when it
    is not an object at all: a JSON list of numbers, say)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with the keys {', '.join(keys)}; this one is a {type(row).__name__}")
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}; required: {', '.join(keys)}")


def resolved_path(reference: str, root: Path, where: str) -> str:
    """``root / reference`` as an absolute path; BadRow (a row ``rows_to_samples`` skips and counts) when it holds
    a NUL byte, which no file system allows (``Path.resolve``, os, PIL and PyAV raise "embedded null byte")."""
    if "\x00" in reference:
        raise BadRow(f"{where}: a file path holds a NUL byte: {reference!r}")
    return str((root / reference).resolve())


def image_from_cell(cell: Any, root: Path, where: str) -> Any | None:
    """A path string, a Hugging Face image cell {"bytes", "path"} or None -> path str, lazy PIL image or None.

    ``Image.open`` on bytes reads only the header; pixels are decoded when the policy first uses the image.
    """
    if cell is None or cell == "":
        return None
    if isinstance(cell, str):
        return resolved_path(cell, root, where)
    if isinstance(cell, dict):
        if cell.get("bytes"):
            return open_lazily(cell["bytes"], where)  # ImageLoadError: the loader skips the row
        if cell.get("path"):
            return resolved_path(cell["path"], root, where)
        return None
    raise ValueError(f"{where}: an image is a path or a {{'bytes', 'path'}} cell, got {type(cell).__name__}")


def jsonl_rows(path: Path, raw: bytes | None = None) -> list[tuple[str, Any]]:
    """``[(where, value)]`` for the non-blank lines of a JSONL file (``raw``: its bytes, e.g. un-gzipped),
    with ``where = "file:line"``. Lines are split on "\\n" only and numbered as an editor numbers them: a text-mode
    read would also split on a lone "\\r" (JSON whitespace) and shift every later number. A line that is not
    UTF-8 or not JSON raises ValueError naming the file, line and column (json's own "line 1" would
    refer to the line alone)."""
    path = Path(path)
    raw = path.read_bytes() if raw is None else raw
    rows = []
    for line_number, line in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{line_number}"
        try:
            text = line.decode("utf-8-sig" if line_number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            reason = f"{error.reason} at column {error.start + 1}"
            raise ValueError(f"{where}: not UTF-8 text ({reason})") from None
        if not text.strip():
            continue
        try:
            rows.append((where, json.loads(text)))
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
    return rows


def utf8_text(path: Path, raw: bytes) -> str:
    """``raw``, the bytes of file ``path``, as text (a byte-order mark dropped); ValueError naming the file, the
    line and the byte when it is not UTF-8 (a file saved as Latin-1 or UTF-16)."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def csv_rows(path: Path) -> list[tuple[str, dict]]:
    """``[(where, row)]`` for the rows of a CSV file under its header line, ``where = "file:line"`` (the line the
    row ends on). A row with more or fewer fields than the header is kept as ``csv.DictReader`` reads it (the
    extra fields as a list under the key None, the missing ones None): the loader decides about it. ValueError
    naming the file and line when the file is not UTF-8 or not CSV, such as a field over csv's limit of
    131,072 characters (an unclosed quote reads the rest of the file as one field)."""
    path = Path(path)
    reader = csv.DictReader(io.StringIO(utf8_text(path, path.read_bytes()), newline=""))
    rows = []
    while True:
        start = reader.line_num + 1  # where the row being read begins (the header, the first time)
        try:
            row = next(reader)
        except StopIteration:
            return rows
        except csv.Error as error:
            raise ValueError(
                f"{path}:{start}: not a CSV row ({error}; from an unclosed quote on that line, the rest of the "
                "file reads as one field)"
            ) from None
        rows.append((f"{path}:{reader.line_num}", row))


def read_rows(path: Path) -> list[tuple[str | None, str, Any]]:
    """``[(key or None, where, row)]`` from a file's rows: JSONL lines, a JSON list, a JSON dict of rows keyed
    by id (key = that id), CSV under a header line (``csv_rows``), or parquet (chosen by suffix). ``where``
    names the row in error messages (``file:line`` for JSONL and CSV)."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pylist()
        return [(None, f"{path}: row {index}", row) for index, row in enumerate(table)]
    if path.suffix.lower() == ".jsonl":
        return [(None, where, row) for where, row in jsonl_rows(path)]
    if path.suffix.lower() == ".csv":
        return [(None, where, row) for where, row in csv_rows(path)]
    raw = path.read_bytes()
    try:
        data = json.loads(utf8_text(path, raw))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: not JSON ({error.msg} at column {error.colno})") from None
    if isinstance(data, list):
        return [(None, f"{path}: row {index}", row) for index, row in enumerate(data)]
    if isinstance(data, dict) and data and all(isinstance(row, dict) for row in data.values()):
        return [(str(key), f"{path}: {key!r}", row) for key, row in data.items()]
    raise ValueError(f"{path}: a JSON file of rows is a list of rows or a dict of rows keyed by id, got {type(data).__name__}")


def rows_to_samples(
    rows: Sequence[tuple[str | None, str, Any]], make_sample: Callable[[dict, str, str], Sample | None], path: Path
) -> list[Sample]:
    """``make_sample(row, sample_id, where)`` for every ``(key, where, row)`` of ``read_rows(path)``, in order.

    The sample id is the row's key, or ``{file stem}_{index}``. A row that is not a JSON object is a ValueError
    naming it; a row whose image cannot be decoded (``ImageLoadError``) or that ``make_sample`` calls a
    ``BadRow`` is skipped and counted (``skip_row``, under "broken_images" or the BadRow's reason), logged once
    per reason for the file: "N rows of FILE skipped: why (first at ROW)". When every row is skipped, that is a
    ValueError saying so (the file is not what the task reads). A ``None`` from ``make_sample`` (a row the task
    does not use) is dropped."""
    samples = []
    skipped: dict[str, tuple[int, str, str]] = {}  # reason -> (rows, where the first was, why)
    for index, (key, where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        try:
            sample = make_sample(row, key if key is not None else f"{Path(path).stem}_{index}", where)
        except (ImageLoadError, BadRow) as error:  # unreadable image bytes, a malformed row: skipped, not fatal
            reason = error.reason if isinstance(error, BadRow) else "broken_images"
            count, first, why = skipped.get(reason, (0, where, str(error).removeprefix(f"{where}: ")))
            skipped[reason] = (count + 1, first, why)
            continue
        if sample is not None:
            samples.append(sample)
    for reason, (count, first, why) in skipped.items():
        skip_row(reason, str(path), f"{why} (first at {first})", rows=count)
    if rows and sum(count for count, _, _ in skipped.values()) == len(rows):
        reasons = "; ".join(f"{n} {reason}: {why} (first at {first})" for reason, (n, first, why) in skipped.items())
        raise ValueError(f"{path}: every row was skipped ({reasons})")
    return samples


def detect_schema(rows: Sequence[tuple[str | None, str, Any]], path: Path, schemas: dict[str, Sequence[str]], task: str) -> str:
    """The first schema whose columns the first row has; ValueError naming the columns found and needed."""
    if not rows:
        raise ValueError(f"{path}: no rows")
    first = rows[0][2]
    if not isinstance(first, dict):
        raise ValueError(f"{path}: rows must be JSON objects, got {type(first).__name__}")
    for schema, columns in schemas.items():
        if all(column in first for column in columns):
            return schema
    described = "; ".join(f"{name}: {', '.join(columns)}" for name, columns in schemas.items())
    raise ValueError(
        f"{path}: unrecognised {task} columns {', '.join(sorted(map(str, first))) or '(none)'}; "
        f"each schema needs these columns: {described}"
    )
