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
from typing import Any, Iterable, Sequence

from unsloth_jax.errors import DatasetFormatError

logger = logging.getLogger(__name__)

FORMATS = ("text", "alpaca", "sharegpt", "chatml")

# Role names accepted in conversations, mapped to the chat-template roles (user / assistant / system / tool).
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
}


class Records(list):
    """A ``list[dict]`` that also remembers where each record came from.

    Attributes:
        source: the path that was loaded (file or directory), or None.
        locations: one ``(file, line)`` pair per record (1-based line), or None per record when unknown
            (records of a ``.json`` file have no line of their own).
        skipped: how many malformed lines/records were dropped (``skip_bad_lines=True``) by the call that
            returned this object, plus those already dropped from its input (load then validate: the total).
    """

    def __init__(self, items: Iterable[dict] = (), *, source: str | None = None,
                 locations: Sequence[tuple[str, int] | None] | None = None, skipped: int = 0):
        super().__init__(items)
        self.source = source
        self.locations = list(locations) if locations is not None else [None] * len(self)
        self.skipped = skipped


def where(records: Sequence[dict], index: int, source: str | None = None) -> str:
    """Human-readable location of ``records[index]``: "file, line N" when known, else "record N"."""
    locations = getattr(records, "locations", None)
    if locations is not None and index < len(locations) and locations[index] is not None:
        path, line = locations[index]
        return f"{path}, line {line}"
    src = source if source is not None else getattr(records, "source", None)
    return f"{src}, record {index}" if src else f"record {index}"


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
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    obj, reason = None, f"invalid JSON ({e.msg} at column {e.colno})"
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


def load_records(path: str | os.PathLike, skip_bad_lines: bool = False) -> Records:
    """Load a dataset as a list of dicts.

    ``path`` is a ``.jsonl`` file (one JSON object per line; blank lines ignored), a ``.json`` file (a list of
    objects, or ``{"data": [...]}``) or a directory, whose ``*.jsonl`` files are read in sorted name order.

    A malformed line (bad JSON, bad UTF-8, not an object) raises DatasetFormatError naming the file, the 1-based
    line number and the reason. With ``skip_bad_lines=True`` such lines are skipped: the count is logged with
    ``logging.warning`` and stored on the result's ``.skipped`` attribute. The result is a :class:`Records`
    (a list subclass) whose ``.locations`` give each record's (file, line) for later error messages.
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
    for f in files:
        name = f.name.lower()
        if name.endswith(".jsonl"):
            skipped += _read_jsonl(f, skip_bad_lines, out, locs)
        elif name.endswith(".json"):
            skipped += _read_json(f, skip_bad_lines, out, locs)
        else:
            raise _bad(str(f), "unsupported file type (expected .jsonl, .json or a directory of .jsonl files)")
    if skipped:
        logger.warning("load_records(%s): skipped %d malformed line(s)", p, skipped)
    return Records(out, source=str(p), locations=locs, skipped=skipped)


# ----------------------------------------------------------------------------------------------- validation
def _check_turns(turns: Any, key: str, role_key: str, content_key: str) -> str | None:
    if not isinstance(turns, list) or not turns:
        return f"field {key!r} must be a non-empty list of turns"
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"{key}[{j}] must be an object, got {type(turn).__name__}"
        # Accept both spellings of a turn: {from, value} (sharegpt) and {role, content} (chatml).
        if role_key in turn or content_key in turn:
            rk, ck = role_key, content_key
        else:
            rk, ck = ("role", "content") if role_key == "from" else ("from", "value")
        if rk not in turn:
            return f"{key}[{j}] has no {rk!r} field"
        role = turn[rk]
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            return f"{key}[{j}] has unknown role {role!r} (expected one of {sorted(ROLE_ALIASES)})"
        if ck not in turn:
            return f"{key}[{j}] has no {ck!r} field"
        if turn[ck] is not None and not isinstance(turn[ck], str):
            return f"{key}[{j}].{ck} must be a string, got {type(turn[ck]).__name__}"
    return None


def record_problem(record: Any, fmt: str, text_field: str = "text") -> str | None:
    """Why ``record`` does not fit format ``fmt`` (a short reason), or None when it fits."""
    if not isinstance(record, dict):
        return f"expected an object, got {type(record).__name__}"
    if fmt == "text":
        if text_field not in record:
            return f"missing field {text_field!r} (text records need a string {text_field!r})"
        if not isinstance(record[text_field], str) or not record[text_field]:
            return f"field {text_field!r} must be a non-empty string"
        return None
    if fmt == "alpaca":
        missing = [k for k in ("instruction", "output") if k not in record]
        if missing:
            return (f"missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
                    "(alpaca records need 'instruction' and 'output'; 'input' may be empty or missing)")
        for k in ("instruction", "output"):
            if not isinstance(record[k], str):
                return f"field {k!r} must be a string, got {type(record[k]).__name__}"
        if not record["instruction"].strip():
            return "field 'instruction' is empty"
        if record.get("input") is not None and not isinstance(record["input"], str):
            return f"field 'input' must be a string, got {type(record['input']).__name__}"
        return None
    if fmt == "sharegpt":
        if "conversations" not in record:
            return "missing field 'conversations' (sharegpt records need a list of {from, value} turns)"
        return _check_turns(record["conversations"], "conversations", "from", "value")
    if fmt == "chatml":
        if "messages" not in record:
            return "missing field 'messages' (chatml records need a list of {role, content} turns)"
        return _check_turns(record["messages"], "messages", "role", "content")
    raise ValueError(f"unknown format {fmt!r}; expected 'auto' or one of {FORMATS}")


def validate_records(records: Sequence[dict], fmt: str = "auto", source: str | None = None,
                     skip_bad_lines: bool = False, text_field: str = "text") -> Records:
    """Check that every record has the fields its format needs.

    ``fmt``: "text", "alpaca", "sharegpt", "chatml", or "auto" (each record's format is detected with
    :func:`unsloth_jax.data.detect_format`). Alpaca needs ``instruction`` and ``output`` (``input`` may be empty
    or missing); sharegpt needs ``conversations`` of {from, value}; chatml needs ``messages`` of {role,
    content}; text needs a non-empty string ``text_field``.

    A bad record raises DatasetFormatError naming "file, line N" when the records came from
    :func:`load_records`, else "<source>, record i" / "record i", and the reason. With ``skip_bad_lines=True``
    bad records are dropped, logged with ``logging.warning``, and counted in the result's ``.skipped`` (which
    also includes the input's own ``.skipped``, if any). Returns the valid records as :class:`Records`.
    """
    from unsloth_jax.data.formats import detect_format  # local import: formats imports this module

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
