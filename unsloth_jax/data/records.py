"""What a dataset record is: the formats, the role table, record locations and the per-record checks.

Shared by :mod:`unsloth_jax.data.loading` (reading and validating files) and :mod:`unsloth_jax.data.formats`
(rendering records to texts); it imports neither, so they do not import each other.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from unsloth_jax.errors import DatasetFormatError

FORMATS = ("text", "alpaca", "sharegpt", "chatml", "prompt_completion")

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


def detect_format(record: dict, text_field: str = "text") -> str:
    """Which format a record is in, checked in this order: "chatml" (has ``messages``), "sharegpt"
    (``conversations``), "alpaca" (``instruction``), "text" (``text_field``), "prompt_completion" (``prompt``
    and/or ``completion``: TRL's standard or conversational form; validation names a missing one).

    "text" before "prompt_completion" matches :func:`unsloth_jax.data.prepare_texts`, where a string
    ``text_field`` wins over the record's other fields.

    Raises DatasetFormatError when none fits.
    """
    if not isinstance(record, dict):
        raise DatasetFormatError(f"expected a record object, got {type(record).__name__}")
    if "messages" in record:
        return "chatml"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record:
        return "alpaca"
    if text_field in record:
        return "text"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    raise DatasetFormatError(
        f"cannot detect the format of a record with keys {sorted(record)[:10]}: expected {text_field!r} (text), "
        "'instruction'/'input'/'output' (alpaca), 'conversations' (sharegpt), 'messages' (chatml) or "
        "'prompt'/'completion' (prompt-completion); or pass formatting_func / dataset_text_field"
    )


# ------------------------------------------------------------------------------------------ per-record checks
def check_turns(turns: Any, key: str, role_key: str, content_key: str, allow_empty: bool = False) -> str | None:
    """Why ``turns`` (the record's field ``key``) is not a list of conversation turns, or None.

    A turn is spelled {role_key, content_key}, or the other spelling ({from, value} vs {role, content}); its
    role must be in :data:`ROLE_ALIASES` and its content a string (or null). ``allow_empty`` accepts [].
    """
    if not isinstance(turns, list) or (not turns and not allow_empty):
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


def _text_problem(record: dict, text_field: str) -> str | None:
    if text_field not in record:
        return f"missing field {text_field!r} (text records need a string {text_field!r})"
    if not isinstance(record[text_field], str) or not record[text_field]:
        return f"field {text_field!r} must be a non-empty string"
    return None


def _alpaca_problem(record: dict) -> str | None:
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


def _prompt_completion_problem(record: dict) -> str | None:
    """TRL's prompt-completion records: both fields strings (standard; the completion non-empty), or both
    lists of turns (conversational; the prompt may be [], the completion not)."""
    missing = [k for k in ("prompt", "completion") if k not in record]
    if missing:
        return (f"missing field {missing[0]!r} (prompt-completion records need 'prompt' and 'completion', both "
                "strings or both lists of {role, content} turns)")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            return "field 'completion' is empty (nothing to train on)"
        return None
    if isinstance(prompt, list) and isinstance(completion, list):
        problem = check_turns(prompt, "prompt", "role", "content", allow_empty=True)
        return problem if problem is not None else check_turns(completion, "completion", "role", "content")
    return ("fields 'prompt' and 'completion' must be both strings (standard) or both lists of turns "
            f"(conversational), got {type(prompt).__name__} and {type(completion).__name__}")


def record_problem(record: Any, fmt: str, text_field: str = "text") -> str | None:
    """Why ``record`` does not fit format ``fmt`` (a short reason; for a missing field, also the fields the record
    has), or None when it fits."""
    problem = _format_problem(record, fmt, text_field)
    if problem is not None and problem.startswith("missing field") and isinstance(record, dict):
        problem += f"; the record has {'fields ' + str(sorted(record)[:10]) if record else 'no fields'}"
    return problem


def _format_problem(record: Any, fmt: str, text_field: str) -> str | None:
    if not isinstance(record, dict):
        return f"expected an object, got {type(record).__name__}"
    if fmt == "text":
        return _text_problem(record, text_field)
    if fmt == "alpaca":
        return _alpaca_problem(record)
    if fmt == "sharegpt":
        if "conversations" not in record:
            return "missing field 'conversations' (sharegpt records need a list of {from, value} turns)"
        return check_turns(record["conversations"], "conversations", "from", "value")
    if fmt == "chatml":
        if "messages" not in record:
            return "missing field 'messages' (chatml records need a list of {role, content} turns)"
        return check_turns(record["messages"], "messages", "role", "content")
    if fmt == "prompt_completion":
        return _prompt_completion_problem(record)
    raise ValueError(f"unknown format {fmt!r}; expected 'auto' or one of {FORMATS}")
