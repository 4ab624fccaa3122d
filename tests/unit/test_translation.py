"""``config from-trl`` / ``from-verl``, faithful or loud (issue 16, finding 4): every value that behaves
differently is listed with both values, fields with a counterpart are translated, the rest is refused with
the reason, Hydra ``defaults:`` files are composed or refused, and every translation passes ``config explain``."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from services.launcher.explain import explain
from services.launcher.interop.translation import InvalidTranslationError, Translation, check, summary, to_toml
from services.launcher.interop.trl import from_trl
from services.launcher.interop.verl import HydraDefaultsError, from_verl, resolve
from shared.config.pipeline import PipelineConfig
from tests.support.processes import ROOT

SUPPORT = ROOT / "tests" / "support"
TRL_DEFAULTS = ROOT / "services" / "launcher" / "trl_defaults" / "trl_1_16_grpo_defaults.json"
VERL_COMPOSED = SUPPORT / "verl_ppo_trainer_composed.yaml"
MINIMAL_TRL = """\
model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
per_device_train_batch_size: 8
num_generations: 8
reward_funcs: [my_rewards.accuracy]
"""


def trl_defaults() -> dict:
    return json.loads(TRL_DEFAULTS.read_text())


def verl_composed() -> dict:
    return yaml.safe_load(VERL_COMPOSED.read_text())


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.launcher", "config", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def differences(result: Translation) -> dict[str, tuple[str, str]]:
    return {d.name: (d.theirs, d.ours) for d in result.differences}


def test_minimal_trl_yaml_lists_each_difference_with_both_values(tmp_path):
    """A minimal TRL YAML used to report '0 option(s) had no counterpart' and nothing else, while staleness,
    the prompt limit, the schedule and the run's length changed silently."""
    result = from_trl(yaml.safe_load(MINIMAL_TRL), trl_defaults())
    listed = differences(result)
    assert listed["max_staleness"][0].startswith("0 (on-policy") and listed["max_staleness"][1].startswith("1 ")
    assert listed["importance_correction"][0].startswith("off (use_vllm = false")
    assert listed["importance_correction"][1] == "on (sequence mask, cap 3.0)"  # TRL's values, translated
    assert listed["max_prompt_length"][0].startswith("none") and listed["max_prompt_length"][1].startswith("512")
    assert listed["lr_scheduler_type"] == ("'linear' (decay to 0)", "cosine decay to 0 (min_lr_ratio = 0.0)")
    assert listed["max_steps"][0].startswith("-1 (train num_train_epochs = 3 epochs")
    assert listed["save_total_limit"][0].startswith("None (every checkpoint is kept)")
    learner = result.tables["learner"]
    assert (learner["loss_type"], learner["importance_mode"], learner["importance_cap"]) == ("dapo", "mask", 3.0)
    assert learner["max_staleness"] == 1 and result.tables["data"]["epochs"] == 3  # written out, not implied

    source = tmp_path / "trl.yaml"
    source.write_text(MINIMAL_TRL)
    out = tmp_path / "ours.toml"
    done = cli("from-trl", str(source), "--trl-defaults", str(TRL_DEFAULTS), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "value(s) differ from TRL's: " in done.stdout and "max_staleness (TRL 0, here 1)" in done.stdout
    assert "importance_correction (TRL off, here on)" in done.stdout
    header = out.read_text().split("\n\n")[0]
    assert "# Behaviour that differs from TRL's" in header
    assert "#   max_staleness: TRL 0 (on-policy" in header and "here 1 (generation runs ahead" in header


def test_trl_fields_with_a_counterpart_are_translated():
    """LoRA, checkpoint cadence and limit, output directory, epochs, dtype and reward_funcs used to be
    listed as having no counterpart."""
    fields = {
        "use_peft": True,
        "lora_r": 32,
        "lora_alpha": 64,
        "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"],
        "save_steps": 50,
        "save_total_limit": 3,
        "output_dir": "out/run",
        "num_train_epochs": 2,
        "bf16": True,
        "reward_funcs": ["think_format_reward", "pkg.rewards.length", "get_soft_overlong_punishment"],
        "reward_weights": [1.0, 0.5, 1.0],
    }
    result = from_trl(fields, trl_defaults())
    assert result.unmapped == []
    learner = result.tables["learner"]
    assert (learner["lora_rank"], learner["lora_alpha"], learner["lora_target_modules"]) == (
        32,
        64.0,
        ["q_proj", "v_proj"],
    )
    assert (learner["checkpoint_every"], learner["keep_checkpoints"]) == (50, 3)
    assert (learner["run_name"], learner["runs_dir"]) == ("run", "out")
    assert not {"checkpoint_dir", "log_dir", "resume"} & set(learner)  # they follow the run's name; resume is ours
    assert learner["compute_dtype"] == "bfloat16" and result.tables["data"]["epochs"] == 2
    assert result.tables["scorer"]["rewards"] == [
        {"name": "think_format_reward", "function": "shared.trl_rewards:think_format_reward", "weight": 1.0},
        {"name": "length", "function": "pkg.rewards:length", "weight": 0.5},
        {"name": "overlong", "params": {"buffer": 256}, "weight": 1.0},
    ]
    assert "get_soft_overlong_punishment" in differences(result)  # TRL's script measures against 1280 tokens
    check(result, "TRL")


def test_trl_defaults_fill_the_trainer_side():
    """GRPOConfig's bf16 = None means bf16 unless fp16 (TRL's own rule); save_steps 500; LoRA only with use_peft."""
    result = from_trl({"lora_r": 8, "max_steps": 1000}, trl_defaults())
    learner = result.tables["learner"]
    assert learner["compute_dtype"] == "bfloat16" and learner["checkpoint_every"] == 500
    assert learner["keep_checkpoints"] == 2  # save_total_limit None keeps every one of the 1000 / 500
    assert "lora_rank" not in learner and any("use_peft is false" in note for note in result.notes)
    assert result.tables["data"]["epochs"] == 0  # max_steps > 0: the Trainer cycles the data, epochs ignored
    peft = from_trl({"use_peft": True}, trl_defaults())
    assert (peft.tables["learner"]["lora_rank"], peft.tables["learner"]["lora_alpha"]) == (16, 32.0)
    assert differences(peft)["lora_dropout"] == ("0.05", "0.0")
    assert "PEFT's choice" in differences(peft)["lora_target_modules"][0]


def test_trl_max_steps_minus_one_means_epochs():
    """max_steps = -1 used to pass through and be refused later by our max_steps >= 1."""
    result = from_trl({"max_steps": -1, "num_train_epochs": 2}, trl_defaults())
    assert result.tables["data"]["epochs"] == 2 and result.tables["learner"]["max_steps"] >= 1
    assert differences(result)["max_steps"][0].startswith("-1 (train num_train_epochs = 2 epochs")
    check(result, "TRL")
    with pytest.raises(ValueError, match="num_train_epochs is not given"):
        from_trl({"max_steps": -1})
    with pytest.raises(ValueError, match="whole number"):
        from_trl({"num_train_epochs": 0.5}, trl_defaults())


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"fp16": True}, "float16 mixed precision is not supported"),
        ({"save_strategy": "epoch"}, "save_strategy = 'epoch'"),
        ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type = 'polynomial'"),
        ({"use_peft": True, "use_dora": True}, "use_dora"),
        ({"resume_from_checkpoint": "out/checkpoint-500"}, "cannot be resumed here"),
        ({"reward_funcs": ["my_reward"]}, "neither TRL's"),
        ({"reward_funcs": ["a.b"], "reward_weights": [1.0, 2.0]}, "2 weight"),
        ({"num_train_epochs": 2, "warmup_ratio": 0.1}, "run's length in steps"),
    ],
)
def test_trl_refuses_what_it_cannot_translate_with_the_reason(fields, reason):
    with pytest.raises(ValueError, match=reason):
        from_trl(fields, trl_defaults())


def test_trl_schedules_translate_to_min_lr_ratio():
    def ratio(**fields):
        return from_trl({"max_steps": 100, **fields}, trl_defaults()).tables["learner"]["min_lr_ratio"]

    assert ratio(lr_scheduler_type="constant") == 1.0 and ratio(lr_scheduler_type="cosine") == 0.0
    assert ratio(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}) == 0.1
    warm = from_trl({"max_steps": 200, "warmup_steps": 0.05, "lr_scheduler_type": "cosine"}, trl_defaults())
    assert warm.tables["learner"]["warmup_steps"] == 10 and "lr_scheduler_type" not in differences(warm)


def test_a_translation_our_settings_refuse_names_the_field():
    """Refused at translation with our settings' reasons, not later by config explain."""
    result = from_trl({"num_generations": 1, "per_device_train_batch_size": 4}, trl_defaults())
    with pytest.raises(InvalidTranslationError, match=r"learner\.group_size: group_size \(G\) is 1"):
        check(result, "TRL")


def test_verl_hydra_defaults_file_is_refused_without_its_composition(tmp_path):
    """verl's ppo_trainer.yaml (a Hydra defaults: file) used to translate with exit code 0 into our defaults."""
    head = SUPPORT / "verl_ppo_trainer_head.yaml"
    with pytest.raises(HydraDefaultsError, match=r"actor@actor_rollout_ref\.actor: dp_actor"):
        from_verl(yaml.safe_load(head.read_text()))
    done = cli("from-verl", str(head), "--allow-unmapped", "-o", str(tmp_path / "out.toml"))
    assert done.returncode == 2 and "--verl-defaults" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.toml").exists()
    # Composed, verl's own PPO file is what it is: GAE with a critic and n = 1, refused for those reasons.
    composed = cli("from-verl", str(head), "--verl-defaults", str(VERL_COMPOSED))
    assert composed.returncode == 2 and "algorithm.adv_estimator" in composed.stderr


def test_verl_hydra_file_takes_the_composed_values():
    result = from_verl(yaml.safe_load((SUPPORT / "verl_grpo_hydra.yaml").read_text()), verl_composed())
    assert result.unmapped == []
    learner = result.tables["learner"]
    assert (learner["groups_per_step"], learner["group_size"], learner["max_staleness"]) == (16, 8, 1)
    assert (learner["weight_decay"], learner["adam_beta2"], learner["min_lr_ratio"]) == (0.01, 0.999, 1.0)
    assert (learner["delta"], learner["loss_type"], learner["beta"]) == (3.0, "dapo", 0.001)  # verl's dual clip
    # ${trainer.project_name}/${trainer.experiment_name} resolved, then the run's name and where runs go
    assert (learner["runs_dir"], learner["run_name"]) == ("checkpoints/verl_examples", "gsm8k")
    assert "checkpoint_dir" not in learner
    assert (learner["checkpoint_every"], learner["resume"], result.tables["data"]["epochs"]) == (20, True, 2)
    assert "model" in learner and learner["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert differences(result)["algorithm.rollout_correction.rollout_is"][0].startswith("null")


def test_verl_interpolations_resolve_or_are_refused():
    lookup = {"data.max_prompt_length": 256, "a.b.x": 3}
    flat = {
        "r.prompt": "${oc.select:data.max_prompt_length,512}",
        "r.other": "${oc.select:missing.key, null}",
        "a.b.y": "${.x}",
        "dir": "ckpt/${a.b.x}",
    }
    resolve(flat, set(flat), lookup)
    assert flat == {"r.prompt": 256, "r.other": None, "a.b.y": 3, "dir": "ckpt/3"}
    with pytest.raises(ValueError, match="only"):
        resolve({"k": "${oc.env:HOME}"}, {"k"}, {})


def test_verl_trainer_side_and_differences():
    document = {
        "data": {"train_batch_size": 8},
        "actor_rollout_ref": {
            "rollout": {"n": 4},
            "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8},
            "model": {"lora_rank": 16, "lora_alpha": 32, "target_modules": ["q_proj"]},
        },
        "algorithm": {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 4.0}},
        "trainer": {"total_epochs": 3, "total_training_steps": 90, "save_freq": 30, "max_actor_ckpt_to_keep": None},
    }
    result = from_verl(document)
    learner = result.tables["learner"]
    assert (learner["lora_rank"], learner["lora_alpha"], learner["lora_target_modules"]) == (16, 32.0, ["q_proj"])
    assert (learner["importance_level"], learner["importance_mode"], learner["importance_cap"]) == (
        "sequence",
        "truncate",
        4.0,
    )
    assert (learner["max_steps"], learner["checkpoint_every"], learner["keep_checkpoints"]) == (90, 30, 3)
    assert result.tables["data"]["epochs"] == 3
    assert differences(result)["max_staleness"][0].startswith("0 (each rollout batch")
    assert "max_staleness (verl 0, here 1)" in summary(result, "verl", None)


def test_every_translated_fixture_passes_config_explain(tmp_path):
    """A realistic verl GRPO excerpt used to give a config that config explain rejected."""
    translations = {
        "trl_minimal": (from_trl(yaml.safe_load(MINIMAL_TRL), trl_defaults()), "TRL"),
        "trl_recipe": (from_trl(yaml.safe_load((SUPPORT / "trl_grpo_recipe.yaml").read_text()), trl_defaults()), "TRL"),
        "verl_gsm8k": (from_verl(yaml.safe_load((SUPPORT / "verl_grpo_gsm8k.yaml").read_text())), "verl"),
        "verl_hydra": (
            from_verl(yaml.safe_load((SUPPORT / "verl_grpo_hydra.yaml").read_text()), verl_composed()),
            "verl",
        ),
    }
    for name, (result, kind) in translations.items():
        text = to_toml(result, Path(f"{name}.yaml"), kind, "the fixture's")
        document = tomllib.loads(text)
        for table in ("generator", "learner"):
            document.setdefault(table, {})["model"] = "/models/m"
        path = tmp_path / f"{name}.toml"
        import tomli_w

        path.write_text(tomli_w.dumps(document))
        assert "completions per prompt (G)" in explain(PipelineConfig.load(path)), name


def test_verl_warmup_share_becomes_steps_or_is_refused_without_the_run_length():
    optim = {"actor_rollout_ref": {"actor": {"optim": {"lr_warmup_steps_ratio": 0.05}}}}
    sized = from_verl({**optim, "trainer": {"total_training_steps": 200}})
    assert sized.tables["learner"]["warmup_steps"] == 10
    with pytest.raises(ValueError, match=r"lr_warmup_steps_ratio = 0\.05 is a share of the run"):
        from_verl(optim)


def test_verl_data_files_validation_loggers_and_checkpointing_translate():
    """data.train_files used to be refused as having no counterpart, so a translated run trained on the
    built-in task; trainer.logger, test_freq and the gradient checkpointing flag were refused too."""
    document = {
        "data": {"train_files": ["a.parquet", "b.parquet"], "val_files": "test.parquet", "prompt_key": "question"},
        "actor_rollout_ref": {"model": {"enable_gradient_checkpointing": True, "use_remove_padding": True}},
        "trainer": {
            "logger": ["console", "wandb", "swanlab"],
            "project_name": "gsm8k",
            "experiment_name": "run-1",
            "test_freq": 5,
            "val_before_train": False,
            "n_gpus_per_node": 8,
        },
    }
    result = from_verl(document)
    assert result.unmapped == [] and result.warnings == []
    data, learner = result.tables["data"], result.tables["learner"]
    assert (data["source"], data["prompt_column"]) == (["a.parquet", "b.parquet"], "question")
    assert (learner["eval_data"], learner["eval_every"], learner["eval_on_start"]) == ("test.parquet", 5, False)
    assert (learner["report_to"], learner["tracking_project"]) == (["wandb"], "gsm8k")
    assert learner["gradient_checkpointing"] is True
    assert sorted(result.no_effect) == [
        "actor_rollout_ref.model.use_remove_padding",
        "trainer.experiment_name",
        "trainer.logger 'console'",
        "trainer.logger 'swanlab'",
        "trainer.n_gpus_per_node",
    ]
    check(result, "verl")


def test_verl_long_prompts_and_a_missing_data_source():
    kept = from_verl({"data": {"train_files": "t.parquet", "filter_overlong_prompts": False, "truncation": "left"}})
    assert differences(kept)["data.filter_overlong_prompts"][0] == (
        "false (prompts longer than max_prompt_length are kept: they are cut ('left'))"
    )
    dropped = from_verl({"data": {"train_files": "t.parquet", "filter_overlong_prompts": True}})
    assert "data.filter_overlong_prompts" not in differences(dropped)
    nothing = from_verl({"data": {"train_batch_size": 8}})
    assert nothing.tables["data"]["source"] == "builtin:arithmetic"
    assert nothing.warnings[0].startswith("the verl file names no dataset (data.train_files)")
    assert "WARNING: the verl file" in summary(nothing, "verl", None)
    assert from_verl({"algorithm": {"use_kl_in_reward": True}}).unmapped == ["algorithm.use_kl_in_reward"]
