"""Reading dataset files (.jsonl, .json, a folder of .jsonl) and checking records against their format.

Every problem is reported as :class:`unsloth_jax.errors.DatasetFormatError` naming the file and the 1-based
line (or, when the line is unknown, the record index) and the reason. With ``skip_bad_lines=True`` the
offending lines/records are dropped instead; the number dropped is logged with ``logging.warning`` and kept on
the returned :class:`Records` as ``.skipped``.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from unsloth_jax.data.records import FORMATS, Records, detect_format, record_problem, where
from unsloth_jax.errors import DatasetFormatError

logger = logging.getLogger(__name__)


def _bad(location: str, reason: str, hint: str = "") -> DatasetFormatError:
    msg = f"{location}: {reason}"
    if hint:
        msg += f". {hint}"
    return DatasetFormatError(msg)


_SKIP_HINT = "Fix it, or pass skip_bad_lines=True to skip malformed lines"


def _read_jsonl(path: Path, skip_bad_lines: bool, out: list, locs: list) -> int:
    skipped = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            reason = None
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                line, reason = "", f"not valid UTF-8 ({e.reason} at byte {e.start})"
            if reason is None:
                if not line.strip():
                    continue  # blank lines are allowed
                line = line.rstrip("\r\n")  # so an error at the end of the line is placed on it, not the next
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    where = "the end of the line, " if e.pos >= len(line.rstrip()) else ""
                    obj, reason = None, f"invalid JSON ({e.msg} at {where}column {e.colno})"
                else:
                    if not isinstance(obj, dict):
                        reason = f"expected a JSON object, got {type(obj).__name__}"
            if reason is not None:
                if not skip_bad_lines:
                    raise _bad(f"{path}, line {lineno}", reason, _SKIP_HINT)
                skipped += 1
                continue
            out.append(obj)
            locs.append((str(path), lineno))
    return skipped


def _read_json(path: Path, skip_bad_lines: bool, out: list, locs: list) -> int:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise _bad(str(path), f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        return 0  # an empty file: load_records reports it with its name
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(f"{path}, line {e.lineno}", f"invalid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise _bad(str(path), 'expected a JSON list of objects or {"data": [...]}, got '
                   f"{type(obj).__name__}" + (f" with keys {sorted(obj)[:8]}" if isinstance(obj, dict) else ""))
    skipped = 0
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            if not skip_bad_lines:
                raise _bad(f"{path}, record {i}", f"expected a JSON object, got {type(item).__name__}",
                           "Fix it, or pass skip_bad_lines=True to skip malformed records")
            skipped += 1
            continue
        out.append(item)
        locs.append(None)
    return skipped


def _read_file(f: Path, skip_bad_lines: bool, out: list, locs: list) -> int:
    """Append the records of one .jsonl / .json file to ``out`` (and their locations to ``locs``); returns
    the number of malformed lines skipped."""
    name = f.name.lower()
    if name.endswith(".jsonl"):
        return _read_jsonl(f, skip_bad_lines, out, locs)
    if name.endswith(".json"):
        return _read_json(f, skip_bad_lines, out, locs)
    raise _bad(str(f), "unsupported file type (expected .jsonl, .json or a directory of .jsonl files)")


def _no_records_reason(skipped: int) -> str:
    if skipped:
        return f"holds no records: all {skipped} non-blank line(s) were malformed and skipped"
    return "holds no records (the file is empty or has only blank lines)"


def load_records(path: str | os.PathLike, skip_bad_lines: bool = False) -> Records:
    """Load a dataset as a list of dicts.

    ``path`` is a ``.jsonl`` file (one JSON object per line; blank lines ignored), a ``.json`` file (a list of
    objects, or ``{"data": [...]}``) or a directory, whose ``*.jsonl`` files are read in sorted name order.

    A malformed line (bad JSON, bad UTF-8, not an object) raises DatasetFormatError naming the file, the 1-based
    line number and the reason. With ``skip_bad_lines=True`` such lines are skipped: the count is logged with
    ``logging.warning`` and stored on the result's ``.skipped`` attribute. The result is a :class:`Records`
    (a list subclass) whose ``.locations`` give each record's (file, line) for later error messages.

    A file without records (empty, only blank lines, ``[]``, or every line skipped) raises DatasetFormatError
    naming it; so does a directory whose files hold none. Empty files among non-empty ones in a directory are
    only logged (``logging.warning``).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset path {p} does not exist (expected a .jsonl/.json file or a directory)")
    if p.is_dir():
        files = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(".jsonl"))
        if not files:
            raise _bad(str(p), "directory holds no .jsonl files")
    else:
        files = [p]
    out: list[dict] = []
    locs: list = []
    skipped = 0
    empty: list[str] = []
    for f in files:
        before = len(out)
        skipped_here = _read_file(f, skip_bad_lines, out, locs)
        skipped += skipped_here
        if len(out) == before:
            if not p.is_dir():
                raise _bad(str(f), _no_records_reason(skipped_here))
            empty.append(f.name)
    if not out:
        raise _bad(str(p), f"directory's .jsonl files hold no records ({', '.join(empty)}: empty, blank or "
                   "skipped lines only)")
    if empty:
        logger.warning("load_records(%s): %d file(s) hold no records: %s", p, len(empty), ", ".join(empty))
    if skipped:
        logger.warning("load_records(%s): skipped %d malformed line(s)", p, skipped)
    return Records(out, source=str(p), locations=locs, skipped=skipped)


# ----------------------------------------------------------------------------------------------- validation
def validate_records(records: Sequence[dict], fmt: str = "auto", source: str | None = None,
                     skip_bad_lines: bool = False, text_field: str = "text") -> Records:
    """Check that every record has the fields its format needs.

    ``fmt``: "text", "alpaca", "sharegpt", "chatml", "prompt_completion", or "auto" (each record's format is
    detected with :func:`unsloth_jax.data.detect_format`). Alpaca needs ``instruction`` and ``output``
    (``input`` may be empty or missing); sharegpt needs ``conversations`` of {from, value}; chatml needs
    ``messages`` of {role, content}; text needs a non-empty string ``text_field``; prompt_completion needs
    ``prompt`` and ``completion``, both strings (the completion non-empty) or both lists of turns (the
    completion non-empty).

    A bad record raises DatasetFormatError naming "file, line N" when the records came from
    :func:`load_records`, else "<source>, record i" / "record i", and the reason. With ``skip_bad_lines=True``
    bad records are dropped, logged with ``logging.warning``, and counted in the result's ``.skipped`` (which
    also includes the input's own ``.skipped``, if any). Returns the valid records as :class:`Records`.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected 'auto' or one of {FORMATS}")
    locations = getattr(records, "locations", None)
    keep, keep_locs, skipped = [], [], 0
    for i, rec in enumerate(records):
        if fmt == "auto":
            try:
                problem = record_problem(rec, detect_format(rec, text_field=text_field), text_field)
            except DatasetFormatError as e:
                problem = str(e)
        else:
            problem = record_problem(rec, fmt, text_field)
        if problem is not None:
            if not skip_bad_lines:
                raise _bad(where(records, i, source), problem,
                           "Fix it, or pass skip_bad_lines=True to skip malformed records")
            skipped += 1
            continue
        keep.append(rec)
        keep_locs.append(locations[i] if locations is not None and i < len(locations) else None)
    if skipped:
        logger.warning("validate_records(%s): skipped %d record(s) that do not fit format %r",
                       source or getattr(records, "source", None) or "records", skipped, fmt)
    src = source if source is not None else getattr(records, "source", None)
    return Records(keep, source=src, locations=keep_locs, skipped=skipped + int(getattr(records, "skipped", 0)))
