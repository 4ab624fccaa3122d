"""The ``[environment]`` table in a pipeline file: read by the generator, checked against the learner's budget,
and shown by ``config explain`` as the per-trajectory token budget (docs/concepts/multi-turn-design.md §2.12)."""

from __future__ import annotations

import pytest

from services.launcher.explain import explain
from shared.config.generator import GeneratorSettings
from shared.config.pipeline import PipelineConfig, PipelineError

BASE = """
[learner]
model = "m"
max_prompt_length = 128
max_completion_length = 256
group_size = 4

[generator]
model = "m"
max_model_len = 512
max_prompts_in_flight = 8
"""


@pytest.fixture
def write(tmp_path, monkeypatch):
    for var in ("REDIS_URL", "STREAM_PREFIX", "LOG_LEVEL", "API_TOKEN"):
        monkeypatch.delenv(var, raising=False)

    def write(extra: str):
        path = tmp_path / "pipeline.toml"
        path.write_text(BASE + extra)
        return path

    return write


def test_the_generator_reads_the_environment_table_and_explain_shows_the_trajectory_budget(write):
    path = write(
        '[environment]\npython = "configs.calculator_env:CalculatorEnv"\nmax_turns = 3\nmax_tool_response_tokens = 32\n'
    )
    assert GeneratorSettings.load(path).environment.max_turns == 3
    text = explain(PipelineConfig.load(path))
    assert "Per trajectory (environment configs.calculator_env:CalculatorEnv, tool parser hermes)" in text
    assert "after the prompt                        <= max_completion_length 256 tokens" in text
    assert "one tool result                         <= max_tool_response_tokens 32" in text
    assert "assistant turns                         <= max_turns 3" in text
    assert "trajectories in flight                  <= max_prompts_in_flight 8 x G 4 = 32" in text


def test_without_an_environment_each_sample_is_one_completion(write):
    pipeline = PipelineConfig.load(write(""))
    assert pipeline.generator.environment is None
    assert "Per sample: one completion (no [environment] table)" in explain(pipeline)


def test_a_tool_result_limit_at_or_past_the_completion_budget_is_refused_naming_both(write):
    with pytest.raises(PipelineError) as refused:
        PipelineConfig.load(write('[environment]\npython = "m:C"\nmax_tool_response_tokens = 256\n'))
    message = str(refused.value)
    assert "environment.max_tool_response_tokens (256)" in message and "learner.max_completion_length (256)" in message
    assert "lower max_tool_response_tokens or raise max_completion_length" in message


def test_min_completion_length_beside_an_environment_is_refused(write, monkeypatch):
    monkeypatch.setenv("LEARNER_MIN_COMPLETION_LENGTH", "8")
    with pytest.raises(PipelineError) as refused:
        PipelineConfig.load(write('[environment]\npython = "m:C"\n'))
    assert "learner.min_completion_length (8) beside an [environment]" in str(refused.value)
    assert PipelineConfig.load(write("")).learner.min_completion_length == 8


def test_an_environment_needs_exactly_one_source(write):
    with pytest.raises(PipelineError) as refused:
        PipelineConfig.load(write('[environment]\npython = "m:C"\nurl = "http://127.0.0.1:9"\n'))
    assert "environment" in str(refused.value)


def test_the_env_reward_reward_without_an_environment_is_refused_naming_the_fix(write):
    with pytest.raises(PipelineError) as refused:
        PipelineConfig.load(write('[scorer]\nrewards = [{name = "env_reward"}]\n'))
    assert "there is no [environment] table" in str(refused.value)
    with_one = write(
        '[scorer]\nrewards = [{name = "env_reward"}]\n[environment]\npython = "m:C"\nmax_tool_response_tokens = 8\n'
    )
    assert PipelineConfig.load(with_one).scorer.rewards[0].name == "env_reward"


def test_a_relative_chat_template_is_found_beside_the_configuration_file(tmp_path, monkeypatch):
    from services.generator.startup import _chat_template
    from shared.lifecycle import NotStarting

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "t.jinja").write_text("{{ messages }}")
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(tmp_path / "pipeline.toml"))
    monkeypatch.chdir("/")
    assert _chat_template("templates/t.jinja") == "{{ messages }}"
    with pytest.raises(NotStarting, match=r"templates/missing\.jinja"):
        _chat_template("templates/missing.jinja")
