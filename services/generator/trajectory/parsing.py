"""Tool calls out of one sampled assistant turn (docs/concepts/multi-turn-design.md §2.7).

``kind = "hermes"`` (or any other name vLLM's ``ToolParserManager`` knows) runs vLLM's own parser, built once
with the tokenizer and the tool schemas, on the decode of the sampled turn (special tokens kept, the close
token left out) with a minimal request holding the tools. ``kind = "transformers"`` runs
``tokenizer.parse_response`` with the tokenizer's ``response_template`` (refused at start when it has none) and
the engine's context as ``prefix``. What comes out is checked against the tools:

- a call naming an unknown tool, or whose arguments are not a JSON object, goes to nobody: it stays in the
  assistant message (so the model's turn is recorded as it was), and its tool message is an error for the
  model (``rejected``), counted as a call and an error;
- output holding the parser's start marker (``<tool_call>``) but yielding no call is ``malformed``: vLLM's
  hermes parser drops *every* call of a turn when one block is bad, so the turn counts as one failed call and is
  final; nothing is retried or made up. For ``"transformers"``, a ``parse_response`` that raises is malformed.

vLLM is imported inside :class:`ToolCallParser` only (it is heavy, and this module stays importable without it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRANSFORMERS = "transformers"  # the tool_parser that uses the tokenizer's response_template
_VLLM_PARSE_ERROR = "Error in extracting tool call from response"  # vLLM's log line for a bad block


@dataclass(frozen=True)
class ParsedTurn:
    """One sampled turn as a conversation message, and what the environment must answer."""

    message: dict[str, Any]  # role "assistant"; content (text before the first call); tool_calls when any
    calls: tuple[dict[str, Any], ...]  # to the environment, in order: {"id", "name", "arguments": dict}
    rejected: tuple[dict[str, Any], ...]  # tool messages answering calls that go to nobody
    malformed: bool  # the start marker was there but no call parsed: one failed call, the turn is final

    @property
    def tool_call_count(self) -> int:
        """Calls the turn made, as the metrics count them (a malformed turn is one failed call)."""
        return len(self.calls) + len(self.rejected) + int(self.malformed)


@dataclass(frozen=True)
class Extracted:
    """What a parser read: the text before the first call and the calls as (name, arguments as JSON text), or
    ``malformed`` when the output tried to call a tool and no call could be read."""

    content: str
    calls: tuple[tuple[str, str], ...] = ()
    malformed: bool = False


class ToolCallParser:
    """Parses sampled turns for one tokenizer and one set of tool schemas (built once per generator).

    ``kind``: ``"transformers"`` (the tokenizer's ``response_template`` through ``parse_response``) or the name
    of one of vLLM's tool parsers (``"hermes"``, ...)."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]], kind: str = "hermes") -> None:
        self.tokenizer = tokenizer
        self.tool_names = tuple(_function(tool)["name"] for tool in tools)
        self.kind = kind
        if kind == TRANSFORMERS:
            self._extract = _TransformersExtractor(tokenizer, tools)
        else:
            self._extract = _VllmExtractor(tokenizer, tools, kind)

    def parse(self, token_ids: Sequence[int], turn: int, context_ids: Sequence[int] | None = None) -> ParsedTurn:
        """The turn ``turn`` (1-based) from its sampled ids, without the close token. ``context_ids``: what the
        engine read before the turn (only ``"transformers"`` uses it: templates may pre-write part of a reply)."""
        text = self._decode(token_ids)
        context = self._decode(context_ids) if context_ids and self.kind == TRANSFORMERS else ""
        extracted = self._extract(text, context)
        if extracted.malformed or not extracted.calls:
            return ParsedTurn({"role": "assistant", "content": text}, (), (), extracted.malformed)
        return checked_turn(extracted.content, extracted.calls, self.tool_names, turn)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def checked_turn(
    content: str, raw_calls: Sequence[tuple[str, str]], tool_names: Sequence[str], turn: int
) -> ParsedTurn:
    """The turn's message and its calls split into those for the environment and those rejected.

    ``raw_calls``: (name, arguments as JSON text) in the order the model wrote them; the j-th gets the id
    ``call_<turn>_<j>``. A rejected call with arguments that are not an object is recorded with ``{}``
    (the wire's ``ToolCall.arguments`` is an object); its error message quotes what the model wrote."""
    message_calls, calls, rejected = [], [], []
    for j, (name, arguments_json) in enumerate(raw_calls):
        call_id = f"call_{turn}_{j}"
        arguments, error = _arguments(arguments_json)
        if error is None and name not in tool_names:
            error = f"unknown tool {name!r}; the tools are: {', '.join(tool_names) or 'none'}"
        message_calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments or {}}}
        )
        if error is None:
            calls.append({"id": call_id, "name": name, "arguments": arguments})
        else:
            rejected.append(_error_message(call_id, name, error))
    message = {"role": "assistant", "content": content, "tool_calls": message_calls}
    return ParsedTurn(message, tuple(calls), tuple(rejected), malformed=False)


def _arguments(arguments_json: str) -> tuple[dict[str, Any] | None, str | None]:
    """(arguments, None) when ``arguments_json`` is a JSON object, else (None, the error for the model)."""
    try:
        value = json.loads(arguments_json)
    except (TypeError, ValueError):
        return None, f"arguments are not valid JSON: {arguments_json!r}"
    if not isinstance(value, dict):
        return None, f"arguments must be a JSON object, got {type(value).__name__}: {arguments_json}"
    return value, None


def _error_message(call_id: str, name: str, error: str) -> dict[str, Any]:
    """The tool message answering a call that reached no tool (TRL's ``{"error": ...}`` shape)."""
    return {"role": "tool", "content": json.dumps({"error": error}), "tool_call_id": call_id, "name": name}


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """A schema's function part: ``{"type": "function", "function": {...}}`` or the bare function."""
    return tool.get("function", tool)


class _VllmExtractor:
    """vLLM's tool parser ``kind`` with a minimal chat request holding the tools; a turn holding the parser's
    start marker (hermes: ``<tool_call>``) from which no call came is malformed."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]], kind: str) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionRequest,
            ChatCompletionToolsParam,
        )
        from vllm.tool_parsers import ToolParserManager

        try:
            parser_class = ToolParserManager.get_tool_parser(kind)
        except KeyError:
            choices = ", ".join([TRANSFORMERS, *ToolParserManager.list_registered()])
            raise ValueError(
                f"unknown tool parser {kind!r}: [environment] tool_parser must be one of {choices}"
            ) from None
        params = [
            ChatCompletionToolsParam.model_validate({"type": "function", "function": _function(t)}) for t in tools
        ]
        self._request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], tools=params or None)
        _quiet_parse_errors(logging.getLogger(parser_class.__module__))
        self._parser = parser_class(tokenizer, params or None)
        self._start_marker: str | None = getattr(self._parser, "tool_call_start_token", None)

    def __call__(self, text: str, context: str) -> Extracted:
        extracted = self._parser.extract_tool_calls(text, self._request)
        if not extracted.tools_called or not extracted.tool_calls:
            return Extracted(text, malformed=bool(self._start_marker) and self._start_marker in text)
        calls = tuple((call.function.name, call.function.arguments) for call in extracted.tool_calls)
        return Extracted(extracted.content or "", calls)


class _TransformersExtractor:
    """``tokenizer.parse_response`` with the tokenizer's ``response_template``; a parse that raises (a call
    block that is not JSON, a call without ``name`` or ``arguments``) is malformed."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]]) -> None:
        if getattr(tokenizer, "response_template", None) is None:
            raise ValueError(
                f"[environment] tool_parser = {TRANSFORMERS!r} needs the tokenizer's response_template, and "
                f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} has none: use a vLLM tool parser "
                'such as tool_parser = "hermes", or a tokenizer whose tokenizer_config.json has one'
            )
        self._tokenizer = tokenizer
        self._tools = [dict(tool) for tool in tools]

    def __call__(self, text: str, context: str) -> Extracted:
        try:
            message = self._tokenizer.parse_response(text, prefix=context, tools=self._tools)
        except (ValueError, KeyError, TypeError):
            return Extracted(text, malformed=True)
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            if not isinstance(function, dict) or "name" not in function:
                return Extracted(text, malformed=True)
            calls.append((str(function["name"]), json.dumps(function.get("arguments"))))
        return Extracted(str(message.get("content") or ""), tuple(calls))


class _QuietParseErrors(logging.Filter):
    """Drops vLLM's traceback for a tool-call block that does not parse: such a turn is counted as malformed
    (a failed call in ``tools/failure_frequency``), and a young policy writes many of them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_VLLM_PARSE_ERROR)


def _quiet_parse_errors(logger: logging.Logger) -> None:
    if not any(isinstance(f, _QuietParseErrors) for f in logger.filters):
        logger.addFilter(_QuietParseErrors())
