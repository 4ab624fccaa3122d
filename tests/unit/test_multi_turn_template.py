"""The chat-template delta between turns and the start check (docs/concepts/multi-turn-design.md §2.4, §2.5).

Real tokenizer (the tiny character-level one, so one character is one token and every expected delta can be
written out), real Jinja templates from tests/support/templates and configs/templates.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.generator.trajectory.template import (
    PrefixBreak,
    TemplateError,
    check_template,
    close_end,
    load_chat_template,
    make_render,
    probe_arguments,
    turn_delta,
)
from tests.support.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "tests" / "support" / "templates"
SMOLLM2_TOOLS = ROOT / "configs" / "templates" / "smollm2_tools.jinja"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * 34"}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["word", "limit"],
        },
    },
}
TOOLS = [CALCULATOR, LOOKUP]
SYSTEM = {"role": "system", "content": "Use the tools."}
USER = {"role": "user", "content": "What is 12 * 34?"}


def _call(turn: int, j: int, name: str, **arguments) -> dict:
    return {"id": f"call_{turn}_{j}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _assistant(content: str, *calls: dict) -> dict:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def _tool(call: dict, content: str) -> dict:
    return {"role": "tool", "content": content, "tool_call_id": call["id"], "name": call["function"]["name"]}


def _two_rounds() -> list[tuple[dict, list[dict]]]:
    """(assistant turn, its tool results) for a two-round conversation: two parallel calls, then one call."""
    first = [_call(1, 0, "calculate", expression="12 * 34"), _call(1, 1, "lookup", word="product", limit=1)]
    second = _call(2, 0, "calculate", expression="408 + 0")
    return [
        (_assistant("Let me compute.", *first), [_tool(first[0], "408"), _tool(first[1], "a result")]),
        (_assistant("", second), [_tool(second, "408")]),
    ]


def _simulate(render, close: int, rounds: list[tuple[dict, list[dict]]]) -> tuple[list[int], list[list[int]]]:
    """Token in, token out over ``rounds``: the engine reads the prompt, samples exactly the template's text of
    each assistant turn (up to and including c*), then reads the delta. Returns the ids read and the deltas."""
    history = [SYSTEM, USER]
    tokens = render(history, True)
    deltas = []
    for assistant, results in rounds:
        history.append(assistant)
        rendered = render(history, False)
        sampled = rendered[len(tokens) : close_end(rendered, close)]
        assert sampled[-1] == close
        delta = turn_delta(render, history, results, close)
        tokens += sampled + delta
        deltas.append(delta)
        history += results
    return tokens, deltas


def test_the_delta_on_plain_chatml_is_exact():
    tokenizer = build_tokenizer()
    render = make_render(tokenizer, TOOLS)
    close = check_template(render, tokenizer, TOOLS)
    assert close == tokenizer.convert_tokens_to_ids("<|im_end|>")
    rounds = _two_rounds()
    tokens, deltas = _simulate(render, close, rounds)
    everything = [SYSTEM, USER] + [m for assistant, results in rounds for m in (assistant, *results)]
    assert tokens == render(everything, True)
    assert tokenizer.decode(deltas[0]) == (
        "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>tool\na result<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(deltas[1]) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"


def test_the_delta_on_a_hermes_tools_template_is_exact():
    tokenizer = build_tokenizer()
    render = make_render(tokenizer, TOOLS, str(TEMPLATES / "chatml_tools.jinja"))
    close = check_template(render, tokenizer, TOOLS)
    rounds = _two_rounds()
    tokens, deltas = _simulate(render, close, rounds)
    everything = [SYSTEM, USER] + [m for assistant, results in rounds for m in (assistant, *results)]
    assert tokens == render(everything, True)
    text = tokenizer.decode(tokens)
    assert '<tools>\n{"type": "function", "function": {"name": "calculate"' in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"word": "product", "limit": 1}}\n</tool_call>' in text
    assert tokenizer.decode(deltas[0]) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\na result\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_close_that_is_not_a_special_token_is_refused():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<END>"])  # an added token, but not a special one
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<END>\n{% endfor %}"
    with pytest.raises(TemplateError, match=r"\(S\).*'<END>'.*not a special token.*chat_template ="):
        check_template(make_render(tokenizer, TOOLS, template), tokenizer, TOOLS)


def test_a_close_written_as_plain_text_is_refused():
    tokenizer = build_tokenizer()
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} [end]\n{% endfor %}"
    with pytest.raises(TemplateError, match=r"\(S\) failed: no end-of-turn token.*' \[end\]\\n'"):
        check_template(make_render(tokenizer, TOOLS, template), tokenizer, TOOLS)


def test_a_history_rewriting_template_is_refused_naming_the_probe_and_the_fix():
    tokenizer = build_tokenizer()
    render = make_render(tokenizer, TOOLS, str(TEMPLATES / "strip_reasoning.jinja"))
    with pytest.raises(TemplateError) as refused:
        check_template(render, tokenizer, TOOLS)
    message = str(refused.value)
    assert "(P) failed on probe 2 (reasoning and a call)" in message
    assert '[environment] chat_template = "path/to/template.jinja"' in message
    assert "chat_template_kwargs" in message
    # both windows decoded, split at the first difference (one character is one token here)
    assert "without the tool messages: 'assistant\\n<t' | 'hink>probe r'" in message
    assert "with them: 'assistant\\n<t' | 'ool_call>{\"n'" in message


def test_the_fix_names_trls_training_template_for_a_family_trl_patches():
    tokenizer = build_tokenizer()
    tokenizer.name_or_path = "Qwen/Qwen3-0.6B"
    render = make_render(tokenizer, TOOLS, str(TEMPLATES / "strip_reasoning.jinja"))
    with pytest.raises(TemplateError, match=r"trl/chat_templates/qwen3_training\.jinja"):
        check_template(render, tokenizer, TOOLS)


def test_a_break_the_probes_miss_is_a_prefix_break_at_run_time():
    tokenizer = build_tokenizer()
    render = make_render(tokenizer, TOOLS, str(TEMPLATES / "break_on_marker.jinja"))
    close = check_template(render, tokenizer, TOOLS)
    call = _call(1, 0, "calculate", expression="1 + 1")
    history = [SYSTEM, USER, _assistant("Calling.", call)]
    assert tokenizer.decode(turn_delta(render, history, [_tool(call, "2")], close)).startswith("\n<|im_start|>tool")
    with pytest.raises(PrefixBreak) as broke:
        turn_delta(render, history, [_tool(call, "REWRITE_HISTORY")], close)
    detail = broke.value.detail  # decoded through the render's tokenizer
    assert "without the tool messages: '\\n<|im_start|>assistant\\n' | 'Calling.<too'" in detail
    assert "with them: '\\n<|im_start|>assistant\\n' | '(rewritten) '" in detail


def test_an_assistant_turn_closed_by_another_token_is_refused():
    """Llama 3.1 ends a tool-calling turn with <|eom_id|>, not its usual close: the last c* in A is then an
    earlier message's, and the delta would hold the assistant turn a second time."""
    tokenizer = build_tokenizer()
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.tool_calls %}<tool_call>{{ m.tool_calls[0].function.name }}</tool_call><s>"
        "{% else %}<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"\(P\) failed on probe 1 .*not closed by the close token"):
        check_template(make_render(tokenizer, TOOLS, template), tokenizer, TOOLS)


def test_a_template_that_cannot_render_tool_messages_is_refused():
    tokenizer = build_tokenizer()
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"probe 1 .*raised TemplateError: roles must alternate.*chat_template ="):
        check_template(make_render(tokenizer, TOOLS, template), tokenizer, TOOLS)


def test_a_generation_prompt_that_is_not_a_prefix_of_the_turn_is_refused():
    tokenizer = build_tokenizer()
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    with pytest.raises(TemplateError, match=r"\(G\) failed.*generation prompt: '.*<think>\\n'"):
        check_template(make_render(tokenizer, TOOLS, template), tokenizer, TOOLS)


def test_the_smollm2_tools_template_passes_the_start_check():
    tokenizer = build_tokenizer()
    render = make_render(tokenizer, [CALCULATOR], str(SMOLLM2_TOOLS))
    close = check_template(render, tokenizer, [CALCULATOR])
    assert close == tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = _call(1, 0, "calculate", expression="12 * 34")
    rounds = [(_assistant("", call), [_tool(call, "408")])]
    tokens, [delta] = _simulate(render, close, rounds)
    assert tokenizer.decode(delta) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 34"}}' in (
        tokenizer.decode(tokens)
    )


def test_the_smollm2_tools_template_keeps_smollm2s_default_system_prompt():
    tokenizer = build_tokenizer()
    plain = tokenizer.decode(make_render(tokenizer, None, str(SMOLLM2_TOOLS))([USER], True))
    assert plain == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = tokenizer.decode(make_render(tokenizer, [CALCULATOR], str(SMOLLM2_TOOLS))([SYSTEM, USER], True))
    assert with_tools.startswith("<|im_start|>system\nUse the tools.\n\n# Tools\n")
    assert with_tools.count("<|im_start|>system") == 1


def test_a_missing_template_file_names_the_setting():
    with pytest.raises(TemplateError, match=r"chat_template = .*must name an existing file"):
        load_chat_template("/nonexistent/template.jinja")


def test_probe_arguments_fit_the_schema():
    parameters = {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "n": {"type": ["integer", "null"]},
            "optional": {"type": "boolean"},
        },
        "required": ["x", "mode", "n"],
    }
    assert probe_arguments(parameters) == {"x": 1.5, "mode": "fast", "n": 1}
    assert probe_arguments({}) == {}


def _smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real BPE tokenizer where the demo converted the model (``make demo``), else None."""
    from services.launcher.prepare_model import default_cache

    path = default_cache() / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.skipif(_smollm2_tokenizer() is None, reason="SmolLM2-135M-Instruct not converted here (make demo)")
def test_the_smollm2_tools_template_on_smollm2s_own_tokenizer():
    tokenizer = _smollm2_tokenizer()
    render = make_render(tokenizer, [CALCULATOR], str(SMOLLM2_TOOLS))
    close = check_template(render, tokenizer, [CALCULATOR])
    assert close == tokenizer.eos_token_id and close in tokenizer.all_special_ids
    call = _call(1, 0, "calculate", expression="12 * 34")
    rounds = [(_assistant("I will use the calculator.", call), [_tool(call, "408")])]
    tokens, [delta] = _simulate(render, close, rounds)
    assert tokens == render([SYSTEM, USER, rounds[0][0], *rounds[0][1]], True)
    assert tokenizer.decode(delta) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
