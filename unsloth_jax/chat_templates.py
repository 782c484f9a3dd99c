"""Unsloth's `unsloth.chat_templates` names, for JAX (a re-export of unsloth_jax.data's functions):

    from unsloth_jax.chat_templates import get_chat_template, train_on_responses_only, standardize_sharegpt
    tokenizer = get_chat_template(tokenizer, chat_template="llama-3.1")      # or "chatml", "qwen-2.5", "gemma"
    dataset = standardize_sharegpt(dataset)                                # {"from", "value"} -> {"role", "content"}
    trainer = train_on_responses_only(trainer, instruction_part="<|start_header_id|>user<|end_header_id|>\\n\\n",
                                      response_part="<|start_header_id|>assistant<|end_header_id|>\\n\\n")
"""
from __future__ import annotations

from typing import Sequence

from unsloth_jax.data.chat_templates import CHAT_TEMPLATE_NAMES, RESPONSE_PARTS, get_chat_template
from unsloth_jax.data.formats import standardize_sharegpt
from unsloth_jax.data.response_only import train_on_responses_only


def standardize_data_formats(dataset: Sequence[dict]) -> list[dict]:
    """Unsloth's standardize_data_formats for conversation datasets: turns spelled {"from", "value"} (sharegpt)
    under "conversations" or "messages" become {"role", "content"}; records without them are returned as they
    are (standardize_sharegpt)."""
    return standardize_sharegpt(dataset)


__all__ = ["get_chat_template", "train_on_responses_only", "standardize_sharegpt", "standardize_data_formats",
           "CHAT_TEMPLATE_NAMES", "RESPONSE_PARTS"]
