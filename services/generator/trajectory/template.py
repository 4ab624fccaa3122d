"""The chat-template delta between two turns, and the start check that proves it exact (design §2.4, §2.5).

Token in, token out: the engine reads the prompt, its own sampled turns and, between two turns, the delta D_k
the template writes for the tool messages and the next assistant header. With R(M, g) the conversation M
rendered to token ids (``g``: add the generation prompt) and c* the token that closes an assistant turn::

    A = R(H_k, False);  e = 1 + last index of c* in A;  B = R(H_k ++ T_k, True)
    (P) B[:e] == A[:e]                 appending the tool messages changes nothing up to m_k's close
    D_k = B[e:]

By (P) the template's text for the conversation is ``text(A[:e]) ++ text(D_k)``, and since c* is a special
token (S) nothing tokenizes across it, so D_k is exact after the tokens the engine really read and wrote.

The start check runs (S), (P) on four probes built with the environment's real tool schemas and (G) (the
generation prompt is a prefix of the rendered assistant turn); a template that fails is refused with the probe,
the first differing position, both token windows decoded and the fix. At run time a failed (P) raises
:class:`PrefixBreak`: the runner ends the trajectory there (``cut = "template_break"``).

Pure: a render function in, token ids and errors out; only :func:`make_render` touches a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.chat import template_ids

Message = Mapping[str, Any]
Render = Callable[[Sequence[Message], bool], list[int]]  # (messages, add_generation_prompt) -> token ids
Decode = Callable[[Sequence[int]], str]

_WINDOW = 12  # tokens shown on each side of the first difference: enough to recognise the template's text
_FIX = (
    'set [environment] chat_template = "path/to/template.jinja" to a prefix-preserving template (one that '
    "renders every earlier turn the same whatever follows it){trl}, or chat_template_kwargs that keep history"
)
# Families whose template TRL replaces by a patched, prefix-preserving copy (trl/chat_templates/, matched by
# the model's name, most specific first).
_TRL_TRAINING_TEMPLATES = (
    ("deepseek-r1-distill", "deepseek_r1_distill_training.jinja"),
    ("qwen3", "qwen3_training.jinja"),
    ("qwen2.5", "qwen2_5_training.jinja"),
    ("gpt-oss", "gptoss_training.jinja"),
    ("glm-4", "glm4moe_training.jinja"),
    ("olmo-3", "olmo3_training.jinja"),
    ("llama-3", "llama3_training.jinja"),
)
_SYSTEM = {"role": "system", "content": "You are a probe of the chat template."}
_USER = {"role": "user", "content": "Probe question?"}
_ANSWER = "Probe answer 42."
_REASONING = "probe reasoning"


class TemplateError(ValueError):
    """The start check refuses the chat template; the message names the probe, the difference and the fix."""


class PrefixBreak(RuntimeError):
    """(P) failed at run time on content the start probes missed; ``detail`` is the decoded difference."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"chat template prefix break: {detail}")
        self.detail = detail


@dataclass(frozen=True)
class ChatRender:
    """R(M, g): ``apply_chat_template`` with the tool schemas, template and kwargs used for the prompt."""

    tokenizer: Any
    tools: tuple[Mapping[str, Any], ...] | None
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in self.tools] if self.tools else None,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **self.chat_template_kwargs,
        )
        return template_ids(encoded)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (what the diff in an error shows)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def make_render(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ChatRender:
    """The render function R; ``chat_template`` is a Jinja template's text or the path of a file holding one
    (None: the tokenizer's own)."""
    return ChatRender(
        tokenizer,
        tuple(tools) if tools else None,
        load_chat_template(chat_template) if chat_template else None,
        dict(chat_template_kwargs or {}),
    )


def load_chat_template(template_or_path: str) -> str:
    """A template's text: ``template_or_path`` itself when it holds Jinja markup, else the file it names."""
    if "{{" in template_or_path or "{%" in template_or_path:
        return template_or_path
    path = Path(template_or_path).expanduser()
    if not path.is_file():
        raise TemplateError(
            f"chat template {template_or_path!r} is neither Jinja text nor a readable file: "
            '[environment] chat_template = "path/to/template.jinja" must name an existing file'
        )
    return path.read_text(encoding="utf-8")


# The delta -----------------------------------------------------------------------------------------------


def turn_delta(
    render: Render, history: Sequence[Message], tool_messages: Sequence[Message], close_token: int
) -> list[int]:
    """D_k: the tokens between m_k's close (``history``'s last message) and the next assistant turn.

    Raises :class:`PrefixBreak` when appending ``tool_messages`` re-renders anything up to m_k's close, or
    when the render of ``history`` holds no close token at all. The diff is decoded when ``render`` has a
    ``decode`` method (as :func:`make_render`'s has)."""
    before = render(history, False)
    end = close_end(before, close_token)
    if end == 0:
        raise PrefixBreak(f"the rendered history holds no close token {close_token}")
    after = render([*history, *tool_messages], True)
    if after[:end] != before[:end]:
        raise PrefixBreak(describe_difference(getattr(render, "decode", None), before[:end], after))
    return after[end:]


def close_end(ids: Sequence[int], close_token: int) -> int:
    """e = 1 + the last index of ``close_token`` in ``ids``; 0 when it does not occur."""
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] == close_token:
            return index + 1
    return 0


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter length when one is the other's prefix)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def describe_difference(decode: Decode | None, expected: Sequence[int], got: Sequence[int]) -> str:
    """Where ``got`` stops starting with ``expected``, with both token windows (decoded when possible)."""
    pos = first_difference(expected, got)
    lo = max(0, pos - _WINDOW)

    def window(ids: Sequence[int]) -> str:
        head, tail = list(ids[lo:pos]), list(ids[pos : pos + _WINDOW])
        if decode is None:
            return f"{head} | {tail}"
        return f"{decode(head)!r} | {decode(tail)!r}"

    return (
        f"first difference at token {pos} of {len(expected)}; "
        f"without the tool messages: {window(expected)}; with them: {window(got)}"
    )


# The start check -----------------------------------------------------------------------------------------


def check_template(render: Render, tokenizer: Any, tools: Sequence[Mapping[str, Any]]) -> int:
    """The start check (S), (P) on the four probes, (G); returns the close token c*.

    Raises :class:`TemplateError` naming the failed check, the probe, the decoded difference and the fix."""
    close = find_close_token(render, tokenizer)
    for name, history, tool_messages in probes(tools):
        try:
            _check_probe(render, tokenizer, name, history, tool_messages, close)
        except TemplateError:
            raise
        except Exception as exc:  # the template refuses the probe's messages (jinja raises many types)
            raise TemplateError(
                f"chat template check failed on probe {name}: rendering it raised {type(exc).__name__}: {exc}. "
                f"The template must render assistant tool calls and tool messages; fix: {_fix(tokenizer)}"
            ) from exc
    _check_generation_prompt(render, tokenizer)
    return close


def find_close_token(render: Render, tokenizer: Any) -> int:
    """(S): the first end-of-sequence or added token after a probe assistant's content, which must be special."""
    ids = render([_USER, {"role": "assistant", "content": _ANSWER}], False)
    start = _content_end(ids, _ANSWER, tokenizer)
    specials = {int(i) for i in tokenizer.all_special_ids}
    candidates = specials | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    close = next((token for token in ids[start:] if token in candidates), None)
    if close is None:
        tail = tokenizer.decode(ids[start:], skip_special_tokens=False)
        raise TemplateError(
            f"chat template check (S) failed: no end-of-turn token after the assistant's content "
            f"(the template writes {tail!r} after it). The delta between turns starts right after the token "
            f"that closes an assistant turn, which must be a special token; fix: {_fix(tokenizer)}"
        )
    if close not in specials:
        raise TemplateError(
            f"chat template check (S) failed: the assistant turn closes with token {close} "
            f"({tokenizer.convert_ids_to_tokens(close)!r}), which is not a special token, so text after it may "
            f"tokenize differently; fix: a template that ends the assistant turn with a special token "
            f"(the tokenizer's eos), {_fix(tokenizer)}"
        )
    return close


def _content_end(ids: Sequence[int], content: str, tokenizer: Any) -> int:
    """The smallest i such that ``ids[:i]`` decodes to text holding ``content`` (binary search)."""

    def holds(i: int) -> bool:
        return content in tokenizer.decode(list(ids[:i]), skip_special_tokens=False)

    if not holds(len(ids)):
        raise TemplateError(
            f"chat template check (S) failed: the rendered assistant turn does not hold its content "
            f"{content!r}; the template must render an assistant message's content as is"
        )
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return lo


def _check_probe(
    render: Render,
    tokenizer: Any,
    name: str,
    history: Sequence[Message],
    tool_messages: Sequence[Message],
    close: int,
) -> None:
    """(P) on one probe, and that the probe's last assistant turn is closed by c* (nothing but blanks after)."""
    before = render(history, False)
    end = close_end(before, close)
    trailing = tokenizer.decode(before[end:], skip_special_tokens=False)
    if end == 0 or trailing.strip():
        raise TemplateError(
            f"chat template check (P) failed on probe {name}: its last assistant turn is not closed by the "
            f"close token {close} ({tokenizer.convert_ids_to_tokens(close)!r}); the template writes {trailing!r} "
            f"after the last one. Every assistant turn must end with the same special token; fix: {_fix(tokenizer)}"
        )
    after = render([*history, *tool_messages], True)
    if after[:end] != before[:end]:
        diff = describe_difference(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False), before, after)
        raise TemplateError(
            f"chat template check (P) failed on probe {name}: appending the tool messages re-renders the "
            f"conversation before them ({diff}). The delta between turns needs a prefix-preserving template; "
            f"fix: {_fix(tokenizer)}"
        )


def _check_generation_prompt(render: Render, tokenizer: Any) -> None:
    """(G): R([sys, u], True) is a prefix of R([sys, u, a], False)."""
    prompt = render([_SYSTEM, _USER], True)
    turn = render([_SYSTEM, _USER, {"role": "assistant", "content": _ANSWER}], False)
    if turn[: len(prompt)] != prompt:
        diff = describe_difference(lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False), prompt, turn)
        raise TemplateError(
            f"chat template check (G) failed: the generation prompt is not a prefix of the rendered assistant "
            f"turn ({diff.replace('without the tool messages', 'generation prompt').replace('with them', 'turn')}). "
            f"What the engine reads before a turn must be how the template renders that turn; fix: {_fix(tokenizer)}"
        )


def _fix(tokenizer: Any) -> str:
    name = str(getattr(tokenizer, "name_or_path", "") or "").lower()
    trl = next((file for key, file in _TRL_TRAINING_TEMPLATES if key in name), None)
    hint = f" (TRL's trl/chat_templates/{trl} is one for this model family)" if trl else ""
    return _FIX.format(trl=hint)


# Probes --------------------------------------------------------------------------------------------------


def probes(tools: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]:
    """The four (name, history ending with an assistant turn, tool messages) probes of §2.4, calling the real
    tools with arguments that fit their schemas (a stand-in tool when there are none)."""
    functions = [dict(t.get("function", t)) for t in tools] or [{"name": "probe_tool", "parameters": {}}]
    first, second = functions[0], functions[-1]
    one = _assistant(1, [first])
    reasoning = _assistant(1, [first], content=f"<think>{_REASONING}</think>", reasoning=_REASONING)
    two = _assistant(1, [first, second])
    round_two = _assistant(2, [second])
    base = [_SYSTEM, _USER]
    return [
        ("1 (one call, one result)", [*base, one], _results(one)),
        ("2 (reasoning and a call)", [*base, reasoning], _results(reasoning)),
        ("3 (two calls, two results)", [*base, two], _results(two)),
        ("4 (two tool rounds)", [*base, one, *_results(one), round_two], _results(round_two)),
    ]


def _assistant(
    turn: int, functions: Sequence[Mapping[str, Any]], content: str = "", reasoning: str | None = None
) -> dict[str, Any]:
    calls = [
        {
            "id": f"call_{turn}_{j}",
            "type": "function",
            "function": {"name": f["name"], "arguments": probe_arguments(f.get("parameters") or {})},
        }
        for j, f in enumerate(functions)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _results(assistant: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "role": "tool",
            "content": f"probe result {j}",
            "tool_call_id": call["id"],
            "name": call["function"]["name"],
        }
        for j, call in enumerate(assistant["tool_calls"])
    ]


_PROBE_VALUES = {"string": "probe", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}


def probe_arguments(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments for a JSON-schema ``parameters`` object: each required property gets a value of its type
    (its first enum value when it has one)."""
    properties = parameters.get("properties") or {}
    arguments: dict[str, Any] = {}
    for name in parameters.get("required") or list(properties):
        spec = properties.get(name) or {}
        kind = spec.get("type", "string")
        kind = kind[0] if isinstance(kind, list) and kind else kind
        arguments[name] = spec["enum"][0] if spec.get("enum") else _PROBE_VALUES.get(kind, "probe")
    return arguments
