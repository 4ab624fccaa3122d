"""Tool calls out of a sampled turn (docs/concepts/multi-turn-design.md §2.7): vLLM's real hermes parser on the tiny
tokenizer's ids, and what we do with its output (ids, unknown tools, non-object arguments, malformed turns)."""

from __future__ import annotations

import json
import logging

import pytest

from services.generator.trajectory.parsing import ParsedTurn, ToolCallParser, checked_turn
from tests.support.tiny_model import build_tokenizer

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {
    "name": "lookup",  # a bare function schema is accepted too
    "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    "return": {"type": "string"},  # get_json_schema adds this for an annotated return type
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def parser(tokenizer):
    return ToolCallParser(tokenizer, [CALCULATOR, LOOKUP])


def _parse(parser, tokenizer, text: str, turn: int = 1) -> ParsedTurn:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # the tiny tokenizer covers every character used here
    return parser.parse(ids, turn)


def _block(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_one_call(parser, tokenizer):
    parsed = _parse(parser, tokenizer, "I will compute it.\n" + _block("calculate", {"expression": "12 * 34"}), 3)
    assert parsed.calls == ({"id": "call_3_0", "name": "calculate", "arguments": {"expression": "12 * 34"}},)
    assert parsed.message == {
        "role": "assistant",
        "content": "I will compute it.\n",
        "tool_calls": [
            {
                "id": "call_3_0",
                "type": "function",
                "function": {"name": "calculate", "arguments": {"expression": "12 * 34"}},
            }
        ],
    }
    assert parsed.rejected == ()
    assert not parsed.malformed
    assert parsed.tool_call_count == 1


def test_two_calls_keep_their_order(parser, tokenizer):
    text = _block("lookup", {"word": "product"}) + "\n" + _block("calculate", {"expression": "1 + 2"})
    parsed = _parse(parser, tokenizer, text, 2)
    assert [(c["id"], c["name"]) for c in parsed.calls] == [("call_2_0", "lookup"), ("call_2_1", "calculate")]
    assert [c["id"] for c in parsed.message["tool_calls"]] == ["call_2_0", "call_2_1"]
    assert parsed.message["content"] == ""


def test_one_bad_block_makes_the_turn_malformed(parser, tokenizer):
    """vLLM's hermes parser drops every call when one block is bad: the turn is one failed call, final."""
    text = (
        _block("calculate", {"expression": "1 + 2"})
        + '\n<tool_call>\n{"name": "lookup", "arguments": {"word": }\n</tool_call>'
    )
    parsed = _parse(parser, tokenizer, text)
    assert parsed.malformed
    assert parsed.calls == () and parsed.rejected == ()
    assert parsed.message == {"role": "assistant", "content": text}
    assert parsed.tool_call_count == 1


def test_an_unclosed_block_without_json_is_malformed(parser, tokenizer):
    assert _parse(parser, tokenizer, "Let me call <tool_call> calculate please").malformed


def test_an_unknown_tool_is_rejected_with_an_error_for_the_model(parser, tokenizer):
    text = _block("search", {"query": "x"}) + _block("calculate", {"expression": "2 * 2"})
    parsed = _parse(parser, tokenizer, text, 1)
    assert [c["id"] for c in parsed.calls] == ["call_1_1"]
    [error] = parsed.rejected
    assert error["role"] == "tool" and error["tool_call_id"] == "call_1_0" and error["name"] == "search"
    assert json.loads(error["content"]) == {"error": "unknown tool 'search'; the tools are: calculate, lookup"}
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["search", "calculate"]
    assert parsed.tool_call_count == 2


@pytest.mark.parametrize("arguments", [[1, 2], "12 * 34", 7, None])
def test_arguments_that_are_not_an_object_are_rejected(parser, tokenizer, arguments):
    parsed = _parse(parser, tokenizer, _block("calculate", arguments))
    assert parsed.calls == ()
    [error] = parsed.rejected
    assert error["tool_call_id"] == "call_1_0"
    assert json.loads(error["content"])["error"].startswith("arguments must be a JSON object, got ")
    assert parsed.message["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {}}
    assert not parsed.malformed


def test_no_call_is_a_plain_message(parser, tokenizer):
    parsed = _parse(parser, tokenizer, "The answer is 408.")
    assert parsed == ParsedTurn({"role": "assistant", "content": "The answer is 408."}, (), (), malformed=False)
    assert "tool_calls" not in parsed.message
    assert parsed.tool_call_count == 0


def test_special_tokens_in_the_turn_are_kept_in_the_text(parser, tokenizer):
    ids = tokenizer.encode("a<|im_start|>b", add_special_tokens=False)
    assert parser.parse(ids, 1).message["content"] == "a<|im_start|>b"


def test_an_unknown_parser_kind_names_the_choices(tokenizer):
    with pytest.raises(ValueError, match=r"unknown tool parser 'hermez'.*tool_parser must be one of .*hermes"):
        ToolCallParser(tokenizer, [CALCULATOR], kind="hermez")


def test_checked_turn_rejects_invalid_json_text():
    parsed = checked_turn("", [("calculate", "{not json")], ["calculate"], 4)
    assert parsed.calls == ()
    assert json.loads(parsed.rejected[0]["content"])["error"].startswith("arguments are not valid JSON")


def test_a_malformed_turn_logs_no_traceback(parser, tokenizer):
    """vLLM logs a traceback for every block that does not parse; the turn is counted as malformed instead."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    vllm_logger = logging.getLogger("vllm.tool_parsers.hermes_tool_parser")
    vllm_logger.addHandler(handler)
    try:
        assert _parse(parser, tokenizer, "<tool_call>{oops</tool_call>").malformed
    finally:
        vllm_logger.removeHandler(handler)
    assert records == []


# The "transformers" kind: tokenizer.parse_response with a response_template ---------------------------------

HERMES_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {"content": "text", "repeats": True, "join": ""},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {
                "type": "function",
                "function": {"name": "{content.name}", "arguments": "{content.arguments}"},
            },
        },
    },
}


@pytest.fixture(scope="module")
def transformers_parser():
    tokenizer = build_tokenizer()
    tokenizer.response_template = HERMES_RESPONSE_TEMPLATE
    return tokenizer, ToolCallParser(tokenizer, [CALCULATOR, LOOKUP], kind="transformers")


def test_transformers_kind_reads_calls_with_the_response_template(transformers_parser):
    tokenizer, parser = transformers_parser
    context = tokenizer.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    text = "Computing." + _block("calculate", {"expression": "3 * 3"}) + "\n" + _block("unknown", {"a": 1})
    parsed = parser.parse(tokenizer.encode(text, add_special_tokens=False), 5, context_ids=context)
    assert parsed.message["content"] == "Computing."
    assert parsed.calls == ({"id": "call_5_0", "name": "calculate", "arguments": {"expression": "3 * 3"}},)
    assert [m["tool_call_id"] for m in parsed.rejected] == ["call_5_1"]


def test_transformers_kind_calls_a_bad_block_malformed(transformers_parser):
    tokenizer, parser = transformers_parser
    text = _block("calculate", {"expression": "1"}) + "<tool_call>{broken</tool_call>"
    parsed = parser.parse(tokenizer.encode(text, add_special_tokens=False), 1)
    assert parsed.malformed and parsed.calls == () and parsed.message == {"role": "assistant", "content": text}


def test_transformers_kind_without_a_call_is_a_plain_message(transformers_parser):
    tokenizer, parser = transformers_parser
    parsed = parser.parse(tokenizer.encode("It is 9.", add_special_tokens=False), 1)
    assert parsed == ParsedTurn({"role": "assistant", "content": "It is 9."}, (), (), malformed=False)


def test_transformers_kind_needs_a_response_template(tokenizer):
    with pytest.raises(ValueError, match=r"tool_parser = 'transformers' needs the tokenizer's response_template"):
        ToolCallParser(tokenizer, [CALCULATOR], kind="transformers")
