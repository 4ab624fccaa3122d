"""A task's prompt as the tokens the generator samples from, in one place.

The generator tokenizes every single-turn prompt with :func:`prompt_ids`, the learner counts prompt lengths
with it (``max_prompt_length``), and the TRL comparison gives TRL the text of :func:`render_chat`: three readers
of one rendering, so a prompt the learner admits is the prompt the generator samples from.

Text is tokenized as it is. Chat messages go through the tokenizer's chat template in
``apply_chat_template``'s shape (:func:`message_dict`: the fields a message sets, none that are None, so a
template's ``is defined`` tests see what the dataset wrote): a final assistant message is continued (a task may
prefill the start of the answer), otherwise a generation prompt is opened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shared.trajectory import ChatMessage


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A wire message in ``apply_chat_template``'s shape (fields that are None left out)."""
    return message.model_dump(mode="json", exclude_none=True)


def template_ids(encoded: Any) -> list[int]:
    """The token ids of ``apply_chat_template(..., tokenize=True)``: a list (transformers 4) or a mapping with
    ``input_ids`` (transformers 5's ``BatchEncoding``)."""
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tokenize: bool) -> Any:
    """``messages`` (``apply_chat_template``'s dicts) through the chat template as the generator sends them: a
    final assistant message continued, otherwise a generation prompt opened. Text, or token ids when
    ``tokenize``."""
    if not messages:
        raise ValueError("a chat prompt needs at least one message")
    prefill = messages[-1]["role"] == "assistant"
    encoded = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=tokenize,
        continue_final_message=prefill,
        add_generation_prompt=not prefill,
    )
    return template_ids(encoded) if tokenize else encoded


def prompt_ids(tokenizer: Any, prompt: str | Sequence[ChatMessage]) -> list[int]:
    """The token ids the generator samples from for ``prompt``: text as it is, chat messages templated."""
    if isinstance(prompt, str):
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    return render_chat(tokenizer, [message_dict(m) for m in prompt], tokenize=True)
