"""A task's prompt becomes the same tokens for every reader: the generator that samples from it, the learner
that counts it against ``max_prompt_length`` and the TRL comparison that gives TRL its text (``shared/chat.py``)."""

from __future__ import annotations

import pytest

from services.generator.engine import Engine, InvalidPromptError
from services.learner.startup import prompt_length_counter
from shared.chat import prompt_ids, render_chat
from shared.trajectory import ChatMessage, ToolCall, ToolFunction
from tests.support.tiny_model import build_tokenizer

# Shows what a template's ``is defined`` tests see: a field a message does not set must not reach it as None.
# (A block tag eats the newline after it, hence the colon after the role.)
PROBING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}"
    "{% if m.name is defined %}[name={{ m.name }}]{% endif %}"
    "{% if m.tool_call_id is defined %}[answers={{ m.tool_call_id }}]{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}[call {{ c.function.name }}"
    "({{ c.function.arguments.x }})]{% endfor %}{% endif %}"
    ":{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QUESTION = (ChatMessage(role="system", content="Answer."), ChatMessage(role="user", content="What is 2+3?"))
PREFILLED = (*QUESTION, ChatMessage(role="assistant", content="<think>"))
TOOL_HISTORY = (
    *QUESTION,
    ChatMessage(
        role="assistant",
        content="",
        tool_calls=(ToolCall(id="c1", function=ToolFunction(name="add", arguments={"x": 2})),),
    ),
    ChatMessage(role="tool", content="5", tool_call_id="c1", name="add"),
    ChatMessage(role="user", content="So?"),
)


def _engine(tokenizer) -> Engine:
    engine = Engine.__new__(Engine)  # tokenize reads nothing but the tokenizer
    engine.tokenizer = tokenizer
    return engine


def _text(tokenizer, prompt) -> str:
    return tokenizer.decode(prompt_ids(tokenizer, prompt), skip_special_tokens=False)


def test_text_is_tokenized_as_it_is():
    tokenizer = build_tokenizer()
    assert prompt_ids(tokenizer, "2+3=") == tokenizer("2+3=")["input_ids"]
    assert _text(tokenizer, "2+3=") == "2+3="


def test_a_chat_that_ends_with_a_question_opens_the_assistant_turn():
    rendered = _text(build_tokenizer(), QUESTION)
    assert rendered == (
        "<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_final_assistant_message_is_continued_not_closed():
    rendered = _text(build_tokenizer(), PREFILLED)
    assert rendered.endswith("<|im_start|>assistant\n<think>")  # no <|im_end|>, no second assistant turn
    assert rendered.count("<|im_start|>assistant") == 1


@pytest.mark.parametrize("prompt", [QUESTION, PREFILLED], ids=["question", "prefill"])
def test_the_text_tokenizes_to_the_ids(prompt):
    """The TRL comparison gives TRL the text, which TRL tokenizes with ``tokenizer(text)``."""
    tokenizer = build_tokenizer()
    messages = [m.model_dump(exclude_none=True) for m in prompt]
    text = render_chat(tokenizer, messages, tokenize=False)
    assert (
        tokenizer(text)["input_ids"] == render_chat(tokenizer, messages, tokenize=True) == prompt_ids(tokenizer, prompt)
    )


def test_the_template_sees_the_fields_a_message_sets_and_no_others():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = PROBING_TEMPLATE
    rendered = _text(tokenizer, TOOL_HISTORY)
    assert "<|im_start|>assistant[call add(2)]:<|im_end|>" in rendered  # the tool call of the history
    assert "<|im_start|>tool[name=add][answers=c1]:5<|im_end|>" in rendered
    assert "<|im_start|>user:So?<|im_end|>" in rendered  # no [name=None] on a message without one
    assert "None" not in rendered


@pytest.mark.parametrize("template", [None, PROBING_TEMPLATE], ids=["chatml", "probing"])
@pytest.mark.parametrize(
    "prompt", ["2+3=", QUESTION, PREFILLED, TOOL_HISTORY], ids=["text", "question", "prefill", "tool-history"]
)
def test_the_learner_counts_the_tokens_the_generator_samples_from(template, prompt):
    """``max_prompt_length`` admits a prompt by the length of the very ids the generator sends vLLM."""
    tokenizer = build_tokenizer()
    if template:
        tokenizer.chat_template = template
    ids = _engine(tokenizer).tokenize(prompt)
    assert ids and all(type(i) is int for i in ids)
    assert prompt_length_counter(tokenizer)(prompt) == len(ids)


def test_a_prompt_the_template_cannot_render_is_an_invalid_prompt():
    tokenizer = build_tokenizer()
    engine = _engine(tokenizer)
    with pytest.raises(InvalidPromptError, match="at least one message"):
        engine.tokenize(())
    tokenizer.chat_template = "{{ raise_exception('this template takes no system message') }}"
    with pytest.raises(InvalidPromptError, match="takes no system message"):
        engine.tokenize(QUESTION)
