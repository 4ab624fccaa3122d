"""One TOML for the pipeline: sections, precedence, validation messages, explain, and TRL/verl translation."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.generator.settings import GeneratorSettings
from services.launcher.config_tools import explain, from_trl, from_verl, load_pipeline, trl_batch, verl_batch
from services.learner.settings import LearnerSettings
from services.scorer.settings import RewardSpec, ScorerSettings
from shared.settings import ConfigFileError
from tests.support.processes import ROOT

CONFIG = """
[common]
redis_url = "redis://:s3cret@127.0.0.1:6379/0"
stream_prefix = "demo"

[generator]
model = "/models/m"
max_model_len = 1024

[scorer]
rewards = [{name = "mark", weight = 0.5}, {name = "hard_format", weight = 0.5}]

[learner]
model = "/models/m"
group_size = 8
groups_per_step = 4
micro_batch_size = 8
max_completion_length = 256
max_prompt_length = 256
max_staleness = 2
sync_every = 2

[data]
source = "builtin:arithmetic"
system_prompt = "Think, then answer."

[launcher]
generators = 2
"""


@pytest.fixture
def config_file(tmp_path, monkeypatch) -> Path:
    for var in ("REDIS_URL", "STREAM_PREFIX", "LOG_LEVEL", "API_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "pipeline.toml"
    path.write_text(CONFIG)
    return path


def test_each_service_reads_its_section_and_common(config_file, monkeypatch):
    monkeypatch.setenv("API_TOKEN", "tok")
    learner = LearnerSettings.load(config_file)
    assert learner.stream_prefix == "demo" and learner.groups_per_step == 4
    assert learner.data.system_prompt == "Think, then answer."
    scorer = ScorerSettings.load(config_file)
    assert [r.name for r in scorer.rewards] == ["mark", "hard_format"]
    generator = GeneratorSettings.load(config_file)
    assert generator.max_model_len == 1024 and generator.api_token.get_secret_value() == "tok"


def test_precedence_init_over_prefixed_env_over_common_env_over_file(config_file, monkeypatch):
    monkeypatch.setenv("API_TOKEN", "tok")
    monkeypatch.setenv("STREAM_PREFIX", "from-common-env")
    assert LearnerSettings.load(config_file).stream_prefix == "from-common-env"
    monkeypatch.setenv("LEARNER_STREAM_PREFIX", "from-learner-env")
    monkeypatch.setenv("LEARNER_DATA__SHUFFLE_SEED", "7")
    learner = LearnerSettings.load(config_file)
    assert learner.stream_prefix == "from-learner-env" and learner.data.shuffle_seed == 7
    assert LearnerSettings.load(config_file, stream_prefix="kw").stream_prefix == "kw"


def test_resolved_settings_mask_secrets(config_file, monkeypatch):
    monkeypatch.setenv("API_TOKEN", "tok")
    masked = str(GeneratorSettings.load(config_file).masked())
    assert "s3cret" not in masked and "tok'" not in masked
    assert "redis://:***@127.0.0.1:6379/0" in masked


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigFileError, match="does not exist"):
        LearnerSettings.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ConfigFileError, match="is not valid TOML"):
        LearnerSettings.load(bad)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(group_size=1), "group_size \\(G\\) is 1; it must be at least 2"),
        (dict(group_size=4, groups_per_step=2, micro_batch_size=16), "exceeds the completions per step"),
        (
            dict(group_size=4, groups_per_step=3, micro_batch_size=8),
            "must be a multiple of micro_batch_size \\(8\\); e.g. micro_batch_size = 6",
        ),
        (dict(model_context=512, max_prompt_length=400, max_completion_length=200), "exceeds the model's context"),
        (dict(model=""), "learner.model is required"),
    ],
)
def test_learner_validation_messages(overrides, message):
    fields = dict(model="/m", api_token="t")
    fields.update(overrides)
    with pytest.raises(ValidationError, match=message):
        LearnerSettings(**fields)


def test_scorer_validation_messages():
    with pytest.raises(ValidationError, match="unknown reward 'corectness'"):
        ScorerSettings(rewards=[RewardSpec(name="corectness")])
    with pytest.raises(ValidationError, match="must start with http:// or https://"):
        ScorerSettings(rewards=[{"name": "judge", "url": "judge.local/score"}])
    with pytest.raises(ValidationError, match="BNPO needs the combined reward inside"):
        ScorerSettings(estimator="bnpo", rewards=[{"name": "overlong"}])


def test_pipeline_cross_checks_report_every_problem(tmp_path, monkeypatch):
    monkeypatch.delenv("API_TOKEN", raising=False)
    path = tmp_path / "bad.toml"
    path.write_text(
        CONFIG.replace("max_model_len = 1024", "max_model_len = 300").replace(
            'name = "mark", weight', 'name = "marks", weight'
        )
    )
    with pytest.raises(ValueError) as error:
        load_pipeline(path)
    text = str(error.value)
    assert "[scorer] rewards.0: unknown reward 'marks'" in text
    path.write_text(CONFIG.replace("max_model_len = 1024", "max_model_len = 300"))
    with pytest.raises(ValueError, match=r"\[generator\] max_model_len \(300\) is below .* \(512\)"):
        load_pipeline(path)


def test_explain_prints_the_step_and_the_equivalents(config_file):
    text = explain(load_pipeline(config_file))
    assert "completions                             32" in text
    assert "micro-batches (gradient accumulation)   4  of 8 completions" in text
    assert "token upper bound                       16384" in text
    assert "optimizer steps per weight sync         2" in text
    assert "groups admitted in flight at most       12" in text
    assert "num_generations = 8" in text and "data.train_batch_size = 4" in text


def test_trl_classic_example():
    batch = trl_batch(per_device_train_batch_size=8, num_generations=2, steps_per_generation=4)
    assert batch.completions_per_generation == 32
    assert batch.prompts_per_generation == 16


def test_verl_classic_example():
    batch = verl_batch(
        train_batch_size=60, rollout_n=12, n_gpus=6, tensor_model_parallel_size=2, ppo_mini_batch_size=60
    )
    assert batch.sequences_per_step == 720
    assert (batch.rollout_workers, batch.prompts_per_rollout_worker) == (3, 20)
    assert (batch.mini_batch_sequences, batch.mini_batch_sequences_per_gpu) == (720, 120)


def test_from_trl_maps_fields_and_lists_the_rest():
    tables, unmapped = from_trl(
        {
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-6,
            "beta": 0.04,
            "epsilon": 0.2,
            "epsilon_high": 0.28,
            "loss_type": "dapo",
            "scale_rewards": False,
            "max_completion_length": 512,
            "use_liger_loss": True,
            "report_to": "wandb",
            "bf16": True,
        }
    )
    learner = tables["learner"]
    assert learner["compute_dtype"] == "bfloat16"  # float32 master weights under bf16 autocast, as TRL's
    assert learner["group_size"] == 4 and learner["groups_per_step"] == 4 and learner["micro_batch_size"] == 8
    assert learner["lr"] == 1e-6 and learner["loss_type"] == "dapo" and learner["epsilon_low"] == 0.2
    assert tables["scorer"]["scale_rewards"] == "none"
    assert unmapped == ["report_to", "use_liger_loss"]


def test_from_verl_maps_fields_and_lists_the_rest():
    document = {
        "data": {"train_batch_size": 60, "max_prompt_length": 512, "max_response_length": 1024},
        "actor_rollout_ref": {
            "rollout": {"n": 12, "tensor_model_parallel_size": 2, "temperature": 1.0, "name": "vllm"},
            "actor": {
                "ppo_mini_batch_size": 60,
                "ppo_micro_batch_size_per_gpu": 4,
                "use_kl_loss": True,
                "kl_loss_coef": 0.001,
                "loss_agg_mode": "token-mean",
                "optim": {"lr": 1e-6},
            },
        },
        "trainer": {"n_gpus_per_node": 6},
    }
    tables, unmapped = from_verl(document)
    assert tables["learner"]["groups_per_step"] == 60 and tables["learner"]["group_size"] == 12
    assert tables["learner"]["beta"] == 0.001 and tables["learner"]["loss_type"] == "dapo"
    assert tables["generator"]["tensor_parallel_size"] == 2
    assert unmapped == ["actor_rollout_ref.rollout.name", "trainer.n_gpus_per_node"]


def test_cli_explain_and_translate(config_file, tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "services.launcher", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    explained = run("config", "explain", str(config_file))
    assert explained.returncode == 0, explained.stderr
    assert "groups admitted in flight at most" in explained.stdout
    trl = tmp_path / "trl.json"
    trl.write_text('{"per_device_train_batch_size": 8, "num_generations": 2, "steps_per_generation": 4, "foo": 1}')
    out = tmp_path / "ours.toml"
    translated = run("config", "from-trl", str(trl), "-o", str(out))
    assert translated.returncode == 0, translated.stderr
    assert tomllib.loads(out.read_text())["learner"]["group_size"] == 2
    assert "#   foo" in out.read_text()
    assert run("--help").returncode == 0
