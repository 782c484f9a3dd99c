"""Chat templates (jinja) that reproduce the ChatML, Llama 3.1, Qwen 2.5 and Gemma conversation formats.

:func:`get_chat_template` installs one on a Hugging Face tokenizer. The templates accept turns spelled either
``{"role", "content"}`` or sharegpt's ``{"from", "value"}`` (human -> user, gpt -> assistant), plus any custom
names given through ``mapping``, so raw sharegpt conversations render without :func:`standardize_sharegpt`.
"""
from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA31_DATE = "26 Jul 2024"

# Special-token strings each template needs, and the token that ends an assistant turn.
TEMPLATE_TOKENS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen-2.5": ("<|im_start|>", "<|im_end|>"),
    "llama-3.1": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
}
STOP_TOKENS = {"chatml": "<|im_end|>", "qwen-2.5": "<|im_end|>", "llama-3.1": "<|eot_id|>",
               "gemma": "<end_of_turn>"}

# (instruction_part, response_part) for train_on_responses_only, per template (and for the alpaca prompt).
RESPONSE_PARTS = {
    "chatml": ("<|im_start|>user\n", "<|im_start|>assistant\n"),
    "qwen-2.5": ("<|im_start|>user\n", "<|im_start|>assistant\n"),
    "llama-3.1": ("<|start_header_id|>user<|end_header_id|>\n\n",
                  "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "gemma": ("<start_of_turn>user\n", "<start_of_turn>model\n"),
    "alpaca": ("### Instruction:\n", "### Response:\n"),
}

_ALIASES = {"chatml": "chatml", "qwen-2.5": "qwen-2.5", "qwen2.5": "qwen-2.5", "qwen25": "qwen-2.5",
            "llama-3.1": "llama-3.1", "llama3.1": "llama-3.1", "llama-31": "llama-3.1", "llama-3": "llama-3.1", "llama-3.2": "llama-3.1", "llama-32": "llama-3.1", "llama-3.3": "llama-3.1",
            "llama-33": "llama-3.1",
            "llama3": "llama-3.1", "gemma": "gemma", "gemma2": "gemma", "gemma-2": "gemma"}

_DEFAULT_MAPPING = {"role": "role", "content": "content", "user": "user", "assistant": "assistant",
                    "system": "system"}


def _lit(s: str) -> str:
    """A jinja string literal for s."""
    return json.dumps(s)


def _preamble(mapping: dict) -> str:
    """Jinja that sets ``ns.norm``: ``messages`` as {"role", "content"} dicts with roles user / assistant /
    system / tool, whichever spelling (mapping, role/content, from/value) each turn uses."""
    m = {**_DEFAULT_MAPPING, **(mapping or {})}
    role_map = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "model": "assistant", "system": "system", "tool": "tool"}
    role_map[m["user"]] = "user"
    role_map[m["assistant"]] = "assistant"
    role_map[m["system"]] = "system"
    role_map_lit = "{" + ", ".join(f"{_lit(k)}: {_lit(v)}" for k, v in sorted(role_map.items())) + "}"

    def pick(var: str, keys: list[str]) -> str:
        keys = list(dict.fromkeys(keys))  # the mapped key first, then the two standard spellings
        out = ""
        for i, k in enumerate(keys[:-1]):
            out += ("{%- if " if i == 0 else "{%- elif ") + _lit(k) + " in message %}"
            out += "{%- set " + var + " = message[" + _lit(k) + "] %}"
        return out + "{%- else %}{%- set " + var + " = message[" + _lit(keys[-1]) + "] %}{%- endif %}"

    return (
        "{%- set role_map = " + role_map_lit + " %}"
        "{%- set ns = namespace(norm=[]) %}"
        "{%- for message in messages %}"
        + pick("r", [m["role"], "role", "from"])
        + pick("c", [m["content"], "content", "value"])
        + "{%- set ns.norm = ns.norm + [{'role': role_map.get(r, r), 'content': (c if c is not none else '')}] %}"
        "{%- endfor %}"
    )


def _chatml(mapping: dict) -> str:
    return _preamble(mapping) + (
        "{%- for m in ns.norm %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def _qwen25(mapping: dict) -> str:
    return _preamble(mapping) + (
        "{%- if ns.norm | length == 0 or ns.norm[0]['role'] != 'system' %}"
        "{{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for m in ns.norm %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def _llama31(mapping: dict) -> str:
    return _preamble(mapping) + (
        "{%- if date_string is not defined %}{%- set date_string = '" + LLAMA31_DATE + "' %}{%- endif %}"
        "{%- if ns.norm | length > 0 and ns.norm[0]['role'] == 'system' %}"
        "{%- set system_message = ns.norm[0]['content'] | trim %}{%- set turns = ns.norm[1:] %}"
        "{%- else %}{%- set system_message = '' %}{%- set turns = ns.norm %}{%- endif %}"
        "{{- bos_token }}"
        "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
        "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
        "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
        "{{- system_message + '<|eot_id|>' }}"
        "{%- for m in turns %}"
        "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    )


def _gemma(mapping: dict) -> str:
    # Gemma has no system role: a leading system message is prepended to the first user turn (as Gemma 3 does).
    return _preamble(mapping) + (
        "{%- if ns.norm | length > 0 and ns.norm[0]['role'] == 'system' %}"
        "{%- set first_prefix = ns.norm[0]['content'] + '\\n\\n' %}{%- set turns = ns.norm[1:] %}"
        "{%- else %}{%- set first_prefix = '' %}{%- set turns = ns.norm %}{%- endif %}"
        "{{- bos_token }}"
        "{%- for m in turns %}"
        "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{%- set prefix = first_prefix if loop.first else '' %}"
        "{{- '<start_of_turn>' + role + '\\n' + prefix + m['content'] | trim + '<end_of_turn>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
    )


_BUILDERS = {"chatml": _chatml, "qwen-2.5": _qwen25, "llama-3.1": _llama31, "gemma": _gemma}
CHAT_TEMPLATE_NAMES = tuple(_BUILDERS)


def canonical_template_name(name: str) -> str:
    key = name.strip().lower().replace("_", "-")
    if key not in _ALIASES:
        raise ValueError(f"unknown chat template {name!r}; expected one of {list(CHAT_TEMPLATE_NAMES)}")
    return _ALIASES[key]


def chat_template_string(name: str, mapping: dict | None = None) -> str:
    """The jinja source of a named template ("chatml", "llama-3.1", "qwen-2.5", "gemma").

    ``mapping`` (Unsloth's spelling) renames the turn keys and role names the template reads, e.g.
    ``{"role": "from", "content": "value", "user": "human", "assistant": "gpt"}``.
    """
    if mapping is not None:
        unknown = set(mapping) - set(_DEFAULT_MAPPING)
        if unknown:
            raise ValueError(f"mapping keys must be among {sorted(_DEFAULT_MAPPING)}, got {sorted(unknown)}")
        if not all(isinstance(v, str) and v for v in mapping.values()):
            raise ValueError("mapping values must be non-empty strings")
    return _BUILDERS[canonical_template_name(name)](mapping or {})


def get_chat_template(tokenizer: Any, chat_template: str = "chatml", mapping: dict | None = None,
                      map_eos_token: bool = True) -> Any:
    """Install a named chat template on a Hugging Face tokenizer (in place) and return the tokenizer.

    ``chat_template``: "chatml", "llama-3.1", "qwen-2.5" or "gemma". Sets ``tokenizer.chat_template`` to our
    jinja template for that family and adds the special-token strings it needs (e.g. ``<|im_start|>``) as
    special tokens when the vocabulary lacks them; a warning says how many were added, because the model's
    embedding matrix must then be resized. With ``map_eos_token=True`` (as in Unsloth) ``tokenizer.eos_token``
    becomes the template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``) so training
    texts and generation stop on it. Nothing is downloaded.
    """
    name = canonical_template_name(chat_template)
    template = chat_template_string(name, mapping)
    vocab = tokenizer.get_vocab()
    missing = [t for t in TEMPLATE_TOKENS[name] if t not in vocab]
    if missing:
        from tokenizers import AddedToken

        added = tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing],
                                     special_tokens=True)
        logger.warning("get_chat_template(%r): added %d special token(s) %s to the tokenizer; resize the model's "
                       "token embeddings (and lm_head) to len(tokenizer)=%d", name, added, missing, len(tokenizer))
    tokenizer.chat_template = template
    if map_eos_token:
        tokenizer.eos_token = STOP_TOKENS[name]
    return tokenizer
