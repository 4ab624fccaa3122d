"""One TOML for the pipeline: sections, precedence, validation messages, explain, and TRL/verl translation."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from services.launcher.explain import explain, trl_batch, verl_batch
from services.launcher.interop.translation import to_toml
from services.launcher.interop.trl import from_trl
from services.launcher.interop.verl import from_verl
from shared.config.base import ConfigFileError
from shared.config.generator import GeneratorSettings
from shared.config.learner import LearnerSettings
from shared.config.pipeline import PipelineConfig, PipelineError, launch_or_exit, load_or_exit, load_service
from shared.config.scorer import RewardSpec, ScorerSettings
from tests.support.launcher import run_pipeline
from tests.support.processes import ROOT

# GRPOConfig's defaults as the installed trl==1.16.0 reports them (TRL is not a dependency of this project).
TRL_DEFAULTS = ROOT / "services" / "launcher" / "trl_defaults" / "trl_1_16_grpo_defaults.json"

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
        (dict(loss_type="cispo", delta=2.0), "has no such ratio: remove delta"),
        (dict(loss_type="geo_mean", ratio_level="sequence"), "set ratio_level = 'token'"),
        (dict(cispo_clip_min=6.0), "cispo_clip_min \\(6.0\\) exceeds cispo_clip_max"),
        (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), "swap them"),
        (dict(adaptive_entropy=True, entropy_coef=2.0), "outside \\[entropy_coef_min, entropy_coef_max\\]"),
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
    with pytest.raises(ValidationError, match="leave scale_rewards at 'group'"):
        ScorerSettings(estimator="rloo", scale_rewards="batch")
    with pytest.raises(ValidationError, match="set estimator = 'grpo'"):
        ScorerSettings(estimator="rloo", reward_aggregation="normalize_then_sum")
    spec = ScorerSettings(
        reward_aggregation="normalize_then_sum", rewards=[{"name": "mark", "weight": 0.5}, {"name": "hard_format"}]
    ).advantage_spec
    assert spec.reward_weights == (0.5, 1.0) and spec.needs_batch


def test_pipeline_cross_checks_report_every_problem(tmp_path, monkeypatch):
    monkeypatch.delenv("API_TOKEN", raising=False)
    path = tmp_path / "bad.toml"
    path.write_text(
        CONFIG.replace("max_model_len = 1024", "max_model_len = 300").replace(
            'name = "mark", weight', 'name = "marks", weight'
        )
    )
    with pytest.raises(ValueError) as error:
        PipelineConfig.load(path)
    text = str(error.value)
    assert "scorer.rewards.0: unknown reward 'marks'" in text
    path.write_text(CONFIG.replace("max_model_len = 1024", "max_model_len = 300"))
    with pytest.raises(
        ValueError, match=r"generator.max_model_len \(300\) is below learner.max_prompt_length .* = 512"
    ):
        PipelineConfig.load(path)


def test_one_gpu_memory_split_is_a_pipeline_check(config_file, tmp_path, monkeypatch):
    """generator.gpu_memory_utilization + learner.gpu_memory_share <= 1 when colocated, the learner's share read
    as the learner reads it (its environment over the file), checked wherever the file is validated."""
    monkeypatch.delenv("LEARNER_GPU_MEMORY_SHARE", raising=False)
    colocated = "[generator]\ngpu_count = 1\nlearner_gpus = '0'\ncolocated = true\ngpu_memory_utilization = 0.6\n"
    path = tmp_path / "one-gpu.toml"
    path.write_text(
        CONFIG.replace("[generator]\n", colocated).replace("[learner]\n", "[learner]\ngpu_memory_share = 0.5\n")
    )
    with pytest.raises(
        ValueError, match=r"generator.gpu_memory_utilization \(0.6\) \+ learner.gpu_memory_share \(0.5\)"
    ):
        PipelineConfig.load(path)
    monkeypatch.setenv("LEARNER_GPU_MEMORY_SHARE", "0.3")  # the learner's environment over the file
    assert PipelineConfig.load(path).learner.gpu_memory_share == 0.3
    monkeypatch.setenv("LEARNER_GPU_MEMORY_SHARE", "half")
    with pytest.raises(ValueError, match=r"learner.gpu_memory_share: Input should be a valid number"):
        PipelineConfig.load(path)
    monkeypatch.setenv("LEARNER_GPU_MEMORY_SHARE", "1.5")
    with pytest.raises(ValueError, match=r"learner.gpu_memory_share: Input should be less than or equal to 1"):
        PipelineConfig.load(path)
    monkeypatch.delenv("LEARNER_GPU_MEMORY_SHARE")
    path.write_text(CONFIG.replace("[generator]\n", colocated))
    with pytest.raises(ValueError, match=r"learner's share of the GPU is not set.* at most 0.40"):
        PipelineConfig.load(path)
    PipelineConfig.load(config_file)  # not colocated: no split to check
    for name, value in {"GENERATOR_MODEL": "/m", "GENERATOR_GPU_COUNT": "2", "GENERATOR_LEARNER_GPUS": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("ASYNCGRPO_CONFIG", raising=False)
    assert not load_service(None, "generator").colocated
    monkeypatch.setenv("GENERATOR_COLOCATED", "true")  # without the file, the learner's share is unknown
    with pytest.raises(PipelineError, match="checked against the learner's table; start with the configuration file"):
        load_service(None, "generator")


def test_the_environment_is_checked_by_the_starting_service_only(config_file, monkeypatch, capsys):
    """API_TOKEN (the generator's) and a plugin's bearer_token_env (the scorer's) are checked when that service
    starts, not by another service validating the whole file nor by `config explain`."""
    monkeypatch.delenv("JUDGE_TOKEN", raising=False)
    judge = '{name = "judge", url = "http://judge/score", bearer_token_env = "JUDGE_TOKEN"}'
    config_file.write_text(CONFIG.replace('{name = "hard_format", weight = 0.5}', judge))
    pipeline = PipelineConfig.load(config_file)  # valid without API_TOKEN or JUDGE_TOKEN: no placeholder needed
    assert load_or_exit(config_file, "learner") == pipeline.learner
    for service, needed in (("generator", "api_token is required: set API_TOKEN"), ("scorer", "'JUDGE_TOKEN'")):
        with pytest.raises(SystemExit) as exited:
            load_or_exit(config_file, service)
        assert exited.value.code == 2 and needed in capsys.readouterr().err, service
    monkeypatch.setenv("API_TOKEN", "tok-" + "x" * 28)  # 32 characters: the shortest accepted
    monkeypatch.setenv("JUDGE_TOKEN", "judge-secret")
    assert load_or_exit(config_file, "generator").api_token.get_secret_value() == "tok-" + "x" * 28
    assert load_or_exit(config_file, "scorer").rewards[1].request_headers() == {"Authorization": "Bearer judge-secret"}


def test_placeholder_and_short_secrets_are_refused_at_start(config_file, monkeypatch, capsys):
    """Every service, with the fix named and the secret never printed; a settings object still takes any token
    (tests build them with short ones): only the starting service checks."""
    for token, problem in (("Change-Me-to-a-long-random-string", "placeholder"), ("x" * 31, "has 31 characters")):
        monkeypatch.setenv("API_TOKEN", token)
        for service in ("generator", "scorer", "learner"):
            with pytest.raises(SystemExit) as exited:
                load_or_exit(config_file, service)
            err = capsys.readouterr().err
            assert exited.value.code == 2 and f"{service}: api_token (API_TOKEN)" in err, err
            assert problem in err and "secrets.token_urlsafe(32)" in err and token not in err, err
    monkeypatch.setenv("API_TOKEN", "x" * 32)
    assert load_or_exit(config_file, "generator").api_token.get_secret_value() == "x" * 32
    monkeypatch.setenv("REDIS_URL", "redis://:change-me-to-another-long-random-string@127.0.0.1:6379/0")
    with pytest.raises(SystemExit):
        load_or_exit(config_file, "scorer")
    err = capsys.readouterr().err
    assert "the Redis password in redis_url is the placeholder" in err and "another-long" not in err, err


def test_a_generator_without_api_token_refuses_to_start(config_file):
    """The real process (its start checks run in shared.service.main), with API_TOKEN unset by the fixture."""
    started = subprocess.run(
        [sys.executable, "-m", "services.generator", "--config", str(config_file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 2, started.stdout + started.stderr
    assert "generator: api_token is required: set API_TOKEN" in started.stderr


def test_the_launcher_checks_what_it_starts(config_file, monkeypatch, capsys):
    config_file.write_text(CONFIG.replace("[learner]\n", "[learner]\nmin_generators = 3\n"))
    assert load_or_exit(config_file, "learner").min_generators == 3  # other deployments scale otherwise
    with pytest.raises(SystemExit) as exited:
        launch_or_exit(config_file)
    assert exited.value.code == 2
    assert "learner.min_generators (3) exceeds launcher.generators (2)" in capsys.readouterr().err


def test_the_file_named_by_the_environment_is_read_whole(config_file, monkeypatch):
    """With no path, $ASYNCGRPO_CONFIG names the file for every table, [launcher] included."""
    monkeypatch.setenv("ASYNCGRPO_CONFIG", str(config_file))
    pipeline = PipelineConfig.load()
    assert pipeline.learner.groups_per_step == 4 and pipeline.launcher.generators == 2


def test_one_context_check_for_the_settings_and_the_loaded_model():
    from services.learner.startup import check_context

    settings = LearnerSettings(model="/m", max_prompt_length=400, max_completion_length=200)
    message = "max_prompt_length (400) + max_completion_length (200) exceeds the model's context (512); lower either"
    assert settings.context_problem(512) == message and settings.context_problem(0) is None
    with pytest.raises(ValueError, match=re.escape(message)):
        check_context(settings, SimpleNamespace(max_position_embeddings=512))
    check_context(settings, SimpleNamespace(max_position_embeddings=600))
    with pytest.raises(ValidationError, match=re.escape(message)):
        LearnerSettings(model="/m", max_prompt_length=400, max_completion_length=200, model_context=512)


def test_launcher_refuses_a_short_generator_context_before_starting_anything(config_file, tmp_path):
    """The done-when of issue 18: the real command exits 2 naming both sides before it starts any process: no
    Redis is asked for or started, no service (no log directory)."""
    logs = tmp_path / "logs"
    config_file.write_text(
        CONFIG.replace("max_model_len = 1024", "max_model_len = 300").replace(
            "generators = 2", f'generators = 2\nlog_dir = "{logs}"'
        )
    )
    with socket.socket() as would_be_redis:
        would_be_redis.bind(("127.0.0.1", 0))
        would_be_redis.listen(8)
        would_be_redis.setblocking(False)
        env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{would_be_redis.getsockname()[1]}/0"}
        result = run_pipeline(config_file, timeout_s=120, env=env)
        with pytest.raises(BlockingIOError):
            would_be_redis.accept()  # nobody connected to ask whether Redis answers
    assert result.returncode == 2, result.stdout + result.stderr
    assert "generator.max_model_len (300) is below learner.max_prompt_length (256)" in result.stderr
    assert "learner.max_completion_length (256) = 512" in result.stderr
    assert "started" not in result.stdout + result.stderr and not logs.exists()


def test_explain_prints_the_step_and_the_equivalents(config_file):
    text = explain(PipelineConfig.load(config_file))
    assert "completions                             32" in text
    assert "micro-batches (gradient accumulation)   4  of 8 completions" in text
    assert "token upper bound                       16384" in text
    assert "optimizer steps per weight sync         2" in text
    assert "groups admitted in flight at most       12" in text
    assert "num_generations = 8" in text and "data.train_batch_size = 4" in text


def test_explain_names_dynamic_sampling_in_trl_and_verl_terms_when_it_is_on(config_file):
    off = explain(PipelineConfig.load(config_file))
    assert "dynamic sampling" not in off and "filter_groups" not in off
    config_file.write_text(config_file.read_text().replace("[scorer]", "[scorer]\ndrop_zero_std_groups = true", 1))
    on = explain(PipelineConfig.load(config_file))
    assert "drop_zero_std_groups: TRL's GRPOTrainer has no dynamic sampling" in on
    assert 'algorithm.filter_groups.enable = true, metric = "seq_reward", max_num_gen_batches = 0 (no bound' in on


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
    result = from_trl(
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
    tables, unmapped = result.tables, result.unmapped
    learner = tables["learner"]
    assert learner["compute_dtype"] == "bfloat16"  # float32 master weights under bf16 autocast, as TRL's
    assert learner["group_size"] == 4 and learner["groups_per_step"] == 4 and learner["micro_batch_size"] == 8
    assert learner["lr"] == 1e-6 and learner["loss_type"] == "dapo" and learner["epsilon_low"] == 0.2
    assert tables["scorer"]["scale_rewards"] == "none"
    assert unmapped == ["use_liger_loss"] and learner["report_to"] == ["wandb"]


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
    result = from_verl(document)
    tables, unmapped = result.tables, result.unmapped
    assert tables["learner"]["groups_per_step"] == 60 and tables["learner"]["group_size"] == 12
    assert tables["learner"]["beta"] == 0.001 and tables["learner"]["loss_type"] == "dapo"
    assert tables["generator"]["tensor_parallel_size"] == 2
    assert unmapped == [] and sorted(result.no_effect) == ["actor_rollout_ref.rollout.name", "trainer.n_gpus_per_node"]


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
    defaults = ["--trl-defaults", str(TRL_DEFAULTS)]
    refused = run("config", "from-trl", str(trl), *defaults, "-o", str(out))
    assert refused.returncode == 2 and "no counterpart here for: foo" in refused.stderr
    translated = run("config", "from-trl", str(trl), *defaults, "--allow-unmapped", "-o", str(out))
    assert translated.returncode == 0, translated.stderr
    assert tomllib.loads(out.read_text())["learner"]["group_size"] == 2
    assert "#   foo" in out.read_text() and "GRPOConfig defaults from" in out.read_text()
    assert run("--help").returncode == 0


def trl_defaults() -> dict:
    return json.loads(TRL_DEFAULTS.read_text())


def learner_from(tables: dict) -> LearnerSettings:
    return LearnerSettings(**{**tables["learner"], "model": "/m", "api_token": "t"})


def test_from_trl_done_when_example_keeps_its_meaning():
    """The issue's example: cispo, sequence ratio, truncation mask, entropy quantile, KL; TRL's own defaults
    fill in the rest (dapo-style token mean, sequence-mask importance correction capped at 3, bias-corrected k3)."""
    fields = {
        "loss_type": "cispo",
        "importance_sampling_level": "sequence",
        "mask_truncated_completions": True,
        "top_entropy_quantile": 0.2,
        "beta": 0.04,
        "epsilon_high": 5.0,
    }
    result = from_trl(fields, trl_defaults())
    assert result.unmapped == []
    s = learner_from(result.tables)
    assert (s.loss_type, s.ratio_level, s.cispo_clip_max) == ("cispo", "sequence", 5.0)
    assert s.mask_truncated_completions and s.top_entropy_quantile == 0.2
    assert (s.beta, s.kl_estimator, s.kl_bias_correction) == (0.04, "k3", True)
    assert (s.importance_correction, s.importance_level, s.importance_mode, s.importance_cap) == (
        True,
        "sequence",
        "mask",
        3.0,
    )
    assert (s.max_completion_length, s.adam_beta2, s.top_k, s.min_p) == (512, 0.999, -1, 0.0)
    assert ScorerSettings(**result.tables.get("scorer", {})).scale_rewards == "group"


def test_from_trl_defaults_come_from_the_given_config_class_values():
    result = from_trl({}, trl_defaults())
    assert result.tables["learner"]["loss_type"] == "dapo"  # TRL's default, not ours
    assert from_trl({}).tables["learner"].get("loss_type") is None  # no defaults: ours apply
    cispo = from_trl({"loss_type": "cispo"}, trl_defaults())
    assert cispo.tables["learner"]["cispo_clip_max"] == 0.2 and "ScaleRL" in cispo.notes[0]


def test_from_trl_maps_every_new_option():
    fields = {
        "loss_type": "vespo",
        "vespo_k_pos": 1.5,
        "vespo_lambda_neg": 2.5,
        "sapo_temperature_pos": 0.9,
        "off_policy_mask_threshold": 0.5,
        "entropy_coef": 0.01,
        "use_adaptive_entropy": True,
        "entropy_target": 0.5,
        "entropy_coef_max": 0.1,
        "use_bias_correction_kl": False,
        "multi_objective_aggregation": "normalize_then_sum",
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 2.5,
        "vllm_importance_sampling_clip_min": 0.5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "delta": 3.0,
    }
    result = from_trl(fields, trl_defaults())
    s = learner_from(result.tables)
    assert (s.loss_type, s.vespo_k_pos, s.vespo_lambda_neg, s.sapo_temperature_pos) == ("vespo", 1.5, 2.5, 0.9)
    assert (s.off_policy_mask_threshold, s.entropy_coef, s.adaptive_entropy, s.entropy_target) == (0.5, 0.01, True, 0.5)
    assert (s.kl_bias_correction, s.importance_level, s.importance_mode) == (False, "token", "truncate")
    assert (s.importance_cap, s.importance_cap_min, s.min_p, s.repetition_penalty) == (2.5, 0.5, 0.05, 1.1)
    assert s.delta is None and any("delta" in note for note in result.notes)  # TRL ignores delta for vespo
    assert result.tables["scorer"]["reward_aggregation"] == "normalize_then_sum"
    assert from_trl({"vllm_importance_sampling_cap": 4.0}).tables["learner"]["importance_cap"] == 4.0


def test_from_trl_reward_funcs_and_weights_become_plugins():
    """reward_funcs names each weighted function (the placeholder your_module:reward_i is gone: issue 16)."""
    result = from_trl(
        {"reward_funcs": ["my_lib.rewards.accuracy", "my_lib.rewards.length"], "reward_weights": [1.0, 0.5]}
    )
    rewards = result.tables["scorer"]["rewards"]
    assert rewards == [
        {"name": "accuracy", "function": "my_lib.rewards:accuracy", "weight": 1.0},
        {"name": "length", "function": "my_lib.rewards:length", "weight": 0.5},
    ]
    assert [spec.kind for spec in ScorerSettings(rewards=rewards).rewards] == ["python", "python"]
    with pytest.raises(ValueError, match="reward_funcs does not name the functions"):
        from_trl({"reward_weights": [1.0, 0.5]})


def test_from_trl_names_what_it_cannot_map():
    with pytest.raises(ValueError, match="loss_type 'gspo_token' is unknown"):
        from_trl({"loss_type": "gspo_token"})
    result = from_trl({"sync_ref_model": True, "ref_model_mixup_alpha": 0.6}, trl_defaults())
    assert result.unmapped == ["ref_model_mixup_alpha", "sync_ref_model"]
    assert from_trl({"sync_ref_model": False, "ref_model_sync_steps": 64}).unmapped == []


def test_from_verl_maps_objectives_kl_and_estimators():
    def translate(actor: dict, algorithm: dict | None = None):
        return from_verl({"actor_rollout_ref": {"actor": actor}, "algorithm": algorithm or {}})

    gspo = translate({"policy_loss": {"loss_mode": "gspo"}, "loss_agg_mode": "token-mean"})
    assert (gspo.tables["learner"]["loss_type"], gspo.tables["learner"]["ratio_level"]) == ("grpo", "sequence")
    cispo = translate({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": 0.2, "clip_ratio_high": 0.3})
    s = learner_from(cispo.tables)
    assert (s.loss_type, s.cispo_clip_min, s.cispo_clip_max) == ("cispo", 0.8, 1.3)
    vanilla = translate({"clip_ratio_c": 3.0, "loss_agg_mode": "seq-mean-token-sum", "use_kl_loss": True})
    s = learner_from(vanilla.tables)
    assert (s.loss_type, s.delta, s.kl_estimator, s.kl_bias_correction) == ("luspo", 3.0, "low_var_kl", False)
    kl_cov = translate({"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.01, "ppo_kl_coef": 0.5}})
    assert learner_from(kl_cov.tables).kl_cov_ratio == 0.01
    k2 = translate({"kl_loss_type": "mse", "entropy_coeff": 0.01})
    assert learner_from(k2.tables).kl_estimator == "k2" and learner_from(k2.tables).entropy_coef == 0.01
    rloo = translate({}, {"adv_estimator": "reinforce_plus_plus_baseline"})
    assert rloo.tables["scorer"]["estimator"] == "reinforce_pp_baseline"
    unmapped = translate({"policy_loss": {"loss_mode": "clip_cov"}, "kl_loss_type": "k3+"}, {"adv_estimator": "gae"})
    assert unmapped.unmapped == [
        "actor_rollout_ref.actor.kl_loss_type",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "algorithm.adv_estimator",
    ]


# --- the learner's max_steps and groups_per_step reach the scorer -----------------------------------------------

_FIGURE_VARS = ("SCORER_MAX_STEPS", "SCORER_GROUPS_PER_STEP", "LEARNER_MAX_STEPS", "LEARNER_GROUPS_PER_STEP")


@pytest.fixture
def no_figure_env(monkeypatch):
    for var in (*_FIGURE_VARS, "ASYNCGRPO_CONFIG"):
        monkeypatch.delenv(var, raising=False)


def test_scorer_takes_max_steps_and_groups_per_step_from_the_learner_table(tmp_path, no_figure_env):
    config = tmp_path / "run.toml"
    tables = '[scorer]\nrewards = [{name = "mark", batched = true}]\n[learner]\nmodel = "/m"\n'
    config.write_text(tables + "max_steps = 30\ngroups_per_step = 3\n")
    assert ScorerSettings.load(config).max_steps is None  # the [scorer] table alone: what loading the file adds
    scorer = load_service(config, "scorer")  # the scorer's own process, this file and no other
    assert (scorer.max_steps, scorer.groups_per_step, scorer.batch_groups) == (30, 3, 3)
    config.write_text(config.read_text() + '[generator]\nmodel = "/m"\n')  # every table: the whole-file path
    pipeline = PipelineConfig.load(config)
    assert (pipeline.scorer.max_steps, pipeline.scorer.groups_per_step) == (30, 3)
    assert load_service(config, "scorer") == pipeline.scorer
    config.write_text(tables)  # the learner's defaults are not set values: nothing to take
    assert (load_service(config, "scorer").max_steps, load_service(config, "scorer").batch_groups) == (None, 8)
    config.write_text("[scorer]\nmax_steps = 9\n")  # no [learner] table (a scorer deployed apart): its own
    assert load_service(config, "scorer").max_steps == 9


def test_translated_configs_give_the_scorer_the_learners_max_steps(tmp_path, no_figure_env, monkeypatch):
    monkeypatch.setenv("LEARNER_MODEL", "/m")
    trl = from_trl({"max_steps": 50, "per_device_train_batch_size": 8, "num_generations": 4}, trl_defaults())
    verl = from_verl({"trainer": {"total_training_steps": 20}, "data": {"train_batch_size": 8}})
    for result, kind, expected in ((trl, "TRL", (50, 2)), (verl, "verl", (20, 8))):
        config = tmp_path / f"{kind}.toml"
        config.write_text(to_toml(result, tmp_path / "source.yaml", kind, ""))
        assert "max_steps" in result.tables["learner"] and "max_steps" not in result.tables.get("scorer", {})
        scorer = load_service(config, "scorer")
        assert (scorer.max_steps, scorer.groups_per_step) == expected


@pytest.mark.parametrize(
    ("tables", "named"),
    [
        ("[scorer]\nmax_steps = 5\n[learner]\nmodel = '/m'\nmax_steps = 7\n", "scorer.max_steps (5"),
        ("[common]\ngroups_per_step = 2\n[learner]\nmodel = '/m'\ngroups_per_step = 4\n", "scorer.groups_per_step (2"),
    ],
)
def test_scorer_and_learner_figures_that_differ_are_refused(tmp_path, no_figure_env, tables, named):
    config = tmp_path / "run.toml"
    config.write_text(tables)
    with pytest.raises(PipelineError, match=re.escape(named)) as caught:
        load_service(config, "scorer")
    (problem,) = caught.value.problems
    assert "differs from learner." in problem and "set" in problem and "in [learner]" in problem
    config.write_text(tables + '[generator]\nmodel = "/m"\n' + "[scorer]\n" * ("[scorer]" not in tables))
    with pytest.raises(PipelineError, match=re.escape(named)):
        PipelineConfig.load(config)


def test_the_same_figure_on_both_sides_is_accepted(tmp_path, no_figure_env, monkeypatch):
    config = tmp_path / "run.toml"
    config.write_text("[scorer]\nmax_steps = 7\n[learner]\nmodel = '/m'\nmax_steps = 7\n")
    assert load_service(config, "scorer").max_steps == 7
    monkeypatch.setenv("SCORER_MAX_STEPS", "8")  # the scorer's own environment counts as its own value
    with pytest.raises(PipelineError, match=re.escape("scorer.max_steps (8")):
        load_service(config, "scorer")


def test_a_batched_reward_over_the_learners_groups_per_step_needs_the_room(tmp_path, no_figure_env):
    config = tmp_path / "run.toml"
    config.write_text(
        '[scorer]\nrewards = [{name = "mark", batched = true}]\n[learner]\nmodel = "/m"\ngroups_per_step = 16\n'
    )
    with pytest.raises(
        PipelineError, match=r"groups_per_step \(16\) exceeds max_groups_in_flight \(8\).*else the learner's\)"
    ):
        load_service(config, "scorer")
    config.write_text(config.read_text().replace("batched = true}]", "batched = true}]\nmax_groups_in_flight = 16"))
    assert load_service(config, "scorer").batch_groups == 16
