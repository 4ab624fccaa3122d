"""The tool-use demo's pieces (docs/concepts/multi-turn-design.md §3 step 19): its configuration validates, its held-out
problems are new builtin:calculator products (never a training row or a worked example), the
prefix-preserving template passes the generator's start check with the calculator's real tool schema (on the
tiny tokenizer always, on SmolLM2's own where the demo converted it), the worked examples are right, and the
feasibility probe's (bench/demo_tools.py) problems, prompts and grading are what its table claims."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.demo_tools import TASKS, VARIANTS, grade, prompt, system_example, task_rows
from environments.python_env import python_environment
from services.generator.trajectory.template import check_template, make_render, turn_delta
from shared.config.pipeline import PipelineConfig
from tests.support.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "demo-tools-cpu.toml"
TEMPLATE = ROOT / "configs" / "templates" / "smollm2_tools.jinja"


@pytest.fixture(scope="module")
def calculator():
    """configs/calculator_env.py as [environment] loads it (bench.demo_tools puts configs/ on sys.path, as the
    generator finds it beside the configuration file)."""
    return python_environment("calculator_env:CalculatorEnv", [], name="calculator")


def _smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer where the demo converted the model (``make demo``), else None."""
    from services.launcher.prepare_model import default_cache

    path = default_cache() / "smollm2-135m-instruct"
    if not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_the_config_validates_with_its_environment_and_template():
    config = PipelineConfig.load(CONFIG)
    environment = config.generator.environment
    assert environment is not None and environment.python == "calculator_env:CalculatorEnv"
    assert (CONFIG.parent / environment.chat_template).is_file()  # beside the configuration, as names resolve
    assert environment.max_tool_response_tokens < config.learner.max_completion_length
    assert config.learner.data.source == "builtin:calculator"


def test_the_held_out_problems_are_new_products_never_a_worked_example():
    """What the evaluation publishes: the [data] prompt (system turn, both worked exchanges) then a new problem."""
    from services.learner.evaluation import load_eval_rows
    from shared.config.learner import LearnerSettings
    from shared.dataset.sources import read_source

    settings = LearnerSettings.load(CONFIG)
    rows = load_eval_rows(settings)
    examples = [m.content for m in settings.data.examples if m.role == "user"]
    training = {row["question"][0]["content"] for row in read_source(settings.data)}
    questions = [row.prompt[-1].content for row in rows]
    assert len(rows) == settings.eval_samples and len(set(questions)) == len(rows)
    assert not set(questions) & (training | set(examples))
    for row, question in zip(rows, questions, strict=True):
        assert row.prompt[0].content == settings.data.system_prompt and len(row.prompt) == 10
        a, b = (int(w.rstrip("?")) for w in question.split() if w.rstrip("?").isdigit())
        assert 100 <= a <= 999 and 10 <= b <= 99 and row.columns["answer"] == str(a * b)


def test_the_configs_worked_tool_calls_are_right_and_well_formed(calculator):
    from calculator_env import CalculatorEnv  # importable once the environment was loaded

    examples = PipelineConfig.load(CONFIG).learner.data.examples
    names = {t["function"]["name"] for t in calculator.tool_schemas()}
    assert len(examples) == 8
    for user, call, result, answer in (examples[:4], examples[4:]):
        [tool_call] = call.tool_calls
        assert (user.role, call.role, result.role, answer.role) == ("user", "assistant", "tool", "assistant")
        assert tool_call.function.name in names and result.tool_call_id == tool_call.id
        assert CalculatorEnv().calculate(**tool_call.function.arguments) == result.content
        assert answer.content == f"<answer>{result.content}</answer>"


def test_the_config_prompts_as_the_probe_measured(calculator):
    """The figures of bench/demo_tools.py's mul3x2 / tools-twoshot row are the config's prompt's."""
    data = PipelineConfig.load(CONFIG).learner.data
    measured = prompt(TASKS["mul3x2"], "tools-twoshot", "What is 123 times 45?")
    assert (data.system_prompt, *data.examples) == (measured[0].content, *measured[1:-1])
    assert not data.assistant_prefill


@pytest.mark.parametrize("tokenizer_name", ["tiny", "smollm2"])
def test_the_template_passes_the_start_check_with_the_calculators_schema(calculator, tokenizer_name):
    tokenizer = build_tokenizer() if tokenizer_name == "tiny" else _smollm2_tokenizer()
    if tokenizer is None:
        pytest.skip("SmolLM2-135M-Instruct not converted here (make demo)")
    tools = calculator.tool_schemas()
    render = make_render(tokenizer, tools, str(TEMPLATE))
    close = check_template(render, tokenizer, tools)
    assert close == tokenizer.convert_tokens_to_ids("<|im_end|>") and close in tokenizer.all_special_ids
    messages = [m.model_dump(exclude_none=True) for m in prompt(TASKS["mul3x2"], "tools-twoshot", "What is 5 * 6?")]
    call = {"id": "call_0_0", "type": "function", "function": {"name": "calculate", "arguments": {"expression": "5*6"}}}
    history = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}]
    tool = {"role": "tool", "content": "30", "tool_call_id": "call_0_0", "name": "calculate"}
    delta = turn_delta(render, history, [tool], close)
    assert tokenizer.decode(delta).startswith("\n<|im_start|>user\n<tool_response>\n30\n</tool_response>")


def test_the_probes_problems_are_distinct_right_and_never_a_worked_example():
    for task in TASKS.values():
        rows = task_rows(task, 200, seed=7)
        questions = [row["question"] for row in rows]
        assert len(set(questions)) == 200
        assert task.question(*task.example) not in questions and task.question(*task.second) not in questions
        assert rows == task_rows(task, 200, seed=7)
    row = task_rows(TASKS["mul3x2"], 1, seed=7)[0]
    a, b = (int(word.rstrip("?")) for word in row["question"].split() if word.rstrip("?").isdigit())
    assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == str(a * b)


def test_each_variant_shows_what_its_name_says():
    task = TASKS["mul2x2"]
    calls = {v: sum(bool(m.tool_calls) for m in prompt(task, v, "What is 12 times 34?")) for v in VARIANTS}
    assert calls == {
        "plain": 0,
        "tools-zero": 0,
        "tools-oneshot": 1,
        "tools-twoshot": 2,
        "tools-system": 0,
        "tools-choice": 1,
    }
    assert '"expression": "47 * 23"' in system_example(task)
    with pytest.raises(ValueError, match="unknown prompt variant 'nope'"):
        prompt(task, "nope", "What is 1 + 1?")


def test_grading_is_the_scorers_answer_tag_with_a_lenient_column():
    assert grade("<answer>1,081</answer>", "1081") == (True, True)
    assert grade("The result is 1081.", "1081") == (False, True)
    assert grade("<answer>1081</answer> or maybe 7", "1081") == (True, False)
    assert grade("no number", "1081") == (False, False)
