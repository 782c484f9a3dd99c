"""Rendering records (text / alpaca / sharegpt / chatml / prompt-completion) to training texts."""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from unsloth_jax.data.records import ROLE_ALIASES, detect_format, record_problem, where
from unsloth_jax.errors import DatasetFormatError

logger = logging.getLogger(__name__)

# The alpaca prompt used by Unsloth's notebooks (with an input), and the standard no-input variant.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:\n{}"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{}\n\n### Response:\n{}"
)


def alpaca_prompt(instruction: str, input: str | None = "", output: str = "") -> str:
    """The alpaca prompt for one example (the no-input variant when ``input`` is empty). With the default
    empty ``output`` this is the inference prompt, ending in "### Response:\\n"."""
    if input is not None and input.strip():
        return ALPACA_PROMPT.format(instruction, input, output)
    return ALPACA_PROMPT_NO_INPUT.format(instruction, output)


def format_alpaca(record: dict, eos_token: str | None = "") -> str:
    """Render an alpaca record (instruction, optional input, output) and append ``eos_token``."""
    problem = record_problem(record, "alpaca")
    if problem is not None:
        raise DatasetFormatError(problem)
    return alpaca_prompt(record["instruction"], record.get("input") or "", record["output"]) + (eos_token or "")


def _turns_to_messages(turns: list, where_: str = "record") -> list[dict]:
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DatasetFormatError(f"{where_}: turn {j} must be an object, got {type(turn).__name__}")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise DatasetFormatError(
                f"{where_}: turn {j} has unknown or missing role {role!r} (expected one of {sorted(ROLE_ALIASES)})")
        if content is not None and not isinstance(content, str):
            raise DatasetFormatError(f"{where_}: turn {j} content must be a string, got {type(content).__name__}")
        out.append({"role": ROLE_ALIASES[role.lower()], "content": content or ""})
    return out


def standardize_sharegpt(records: Sequence[dict]) -> list[dict]:
    """Convert sharegpt turns ``{"from", "value"}`` to ``{"role", "content"}`` (human->user, gpt->assistant,
    system->system; also model/chatgpt->assistant, tool/function->tool).

    Like Unsloth's function, the turns stay under the record's ``conversations`` key (and ``messages`` turns in
    sharegpt spelling are converted too); other fields are kept. Returns new dicts; the input is not modified.
    """
    out = []
    for i, rec in enumerate(records):
        new = dict(rec)
        for key in ("conversations", "messages"):
            if key in rec:
                if not isinstance(rec[key], list):
                    raise DatasetFormatError(f"{where(records, i)}: field {key!r} must be a list of turns")
                new[key] = _turns_to_messages(rec[key], where(records, i))
        out.append(new)
    return out


def record_to_messages(record: dict) -> list[dict]:
    """The conversation of a sharegpt or chatml record as a list of {"role", "content"} dicts."""
    key = "messages" if "messages" in record else "conversations"
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise DatasetFormatError(f"field {key!r} must be a non-empty list of turns")
    return _turns_to_messages(turns)


def render_messages(messages: list[dict], tokenizer: Any, add_generation_prompt: bool = False) -> str:
    """Render a conversation with the tokenizer's chat template (``tokenizer.apply_chat_template``)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise DatasetFormatError(
            "the tokenizer has no chat template, so conversations cannot be rendered; call "
            "unsloth_jax.data.get_chat_template(tokenizer, 'chatml') (or 'llama-3.1', 'qwen-2.5', 'gemma') first")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_completion_texts(record: dict, tokenizer: Any = None) -> tuple[str, str]:
    """(prompt text, full training text) of a TRL prompt-completion record. The full text starts with the
    prompt text (conversational: where the template's generation prompt opens the assistant turn the way the
    template writes it, as in every bundled template).

    Standard (strings): the prompt, and prompt + completion + ``tokenizer.eos_token`` (unless the completion
    already ends with it), as TRL's SFTTrainer adds EOS. Conversational (lists of turns): the prompt turns
    rendered with the chat template and its generation prompt, and prompt + completion turns rendered as one
    conversation (the template closes the assistant turn).
    """
    problem = record_problem(record, "prompt_completion")
    if problem is not None:
        raise DatasetFormatError(problem)
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str):
        eos = getattr(tokenizer, "eos_token", None) or ""
        return prompt, prompt + completion + ("" if completion.endswith(eos) else eos)
    prompt_msgs = _turns_to_messages(prompt, "prompt")
    completion_msgs = _turns_to_messages(completion, "completion")
    prompt_text = render_messages(prompt_msgs, tokenizer, add_generation_prompt=True)
    return prompt_text, render_messages(prompt_msgs + completion_msgs, tokenizer)


def render_record(record: dict, tokenizer: Any = None, text_field: str = "text") -> str:
    """One training text for a record of any supported format (format auto-detected)."""
    fmt = detect_format(record, text_field=text_field)
    problem = record_problem(record, fmt, text_field)
    if problem is not None:
        raise DatasetFormatError(problem)
    if fmt == "text":
        return record[text_field]
    if fmt == "alpaca":
        return format_alpaca(record, getattr(tokenizer, "eos_token", None) or "")
    if fmt == "prompt_completion":
        return prompt_completion_texts(record, tokenizer)[1]
    return render_messages(record_to_messages(record), tokenizer)


def prepare_texts(records: Sequence[dict], tokenizer: Any, dataset_text_field: str = "text",
                  formatting_func: Callable[[dict], str | list[str]] | None = None) -> list[str]:
    """Turn records into training texts.

    Precedence, per record: ``formatting_func(record)`` (returning a str, or a list of str that are all
    kept); else the string field ``dataset_text_field`` when present; else the format is auto-detected:
    alpaca is rendered with :data:`ALPACA_PROMPT` (or the no-input variant) plus ``tokenizer.eos_token``;
    sharegpt/chatml conversations with ``tokenizer.apply_chat_template`` (see :func:`get_chat_template`);
    prompt-completion records as prompt followed by completion (see :func:`prompt_completion_texts`).
    Errors name the record's file and line when ``records`` came from :func:`load_records`.
    """
    texts: list[str] = []
    for i, rec in enumerate(records):
        try:
            if formatting_func is not None:
                out = formatting_func(rec)
                if isinstance(out, str):
                    texts.append(out)
                elif isinstance(out, (list, tuple)) and all(isinstance(t, str) for t in out):
                    texts.extend(out)
                else:
                    raise DatasetFormatError(
                        f"formatting_func must return a str or a list of str, got {type(out).__name__}")
            elif isinstance(rec, dict) and isinstance(rec.get(dataset_text_field), str):
                texts.append(rec[dataset_text_field])
            else:
                texts.append(render_record(rec, tokenizer, text_field=dataset_text_field))
        except DatasetFormatError as e:
            raise DatasetFormatError(f"{where(records, i)}: {e}") from None
    return texts
