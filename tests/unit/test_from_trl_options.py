"""``config from-trl``, one option at a time (issue 35, items 1-2): the dataset arguments, evaluation, trackers,
completion tables, vLLM's placement, the options with no effect here, and the packaged TRL defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from services.launcher.interop.translation import BUILTIN_SOURCE, Translation, check, to_toml
from services.launcher.interop.trl import PINNED_TRL_VERSION, TRL_NO_EFFECT, TRL_READ, from_trl, pinned_trl_defaults
from shared.config.data import DataSettings

DATASET = {"dataset_name": "openai/gsm8k", "dataset_config": "main", "max_steps": 200}


def translate(**fields) -> Translation:
    return from_trl(fields, pinned_trl_defaults())


def test_the_packaged_defaults_hold_every_option_read_that_trl_1_16_has():
    """Options read but absent from TRL 1.16 / transformers 5.19 (kept for older files) are the only gaps."""
    assert PINNED_TRL_VERSION == "1.16.0"
    missing = set(TRL_READ) - set(pinned_trl_defaults())
    assert missing == {"max_prompt_length", "warmup_ratio", "model_name_or_path"}
    assert "_comment" not in pinned_trl_defaults()


def test_the_dataset_arguments_become_the_data_table():
    result = translate(**DATASET, dataset_train_split="train[:90%]", data_seed=7)
    assert result.tables["data"] == {
        "source": "openai/gsm8k",
        "dataset_config": "main",
        "train_split": "train[:90%]",
        "shuffle_seed": 7,
        "epochs": 0,
    }
    assert result.warnings == [] and "eval_split" not in result.tables["data"]  # eval_strategy 'no', as TRL's
    DataSettings(**result.tables["data"])


def test_without_dataset_name_the_source_is_written_out_with_a_warning():
    result = translate(dataset_config="main", dataset_test_split="validation")
    assert result.tables["data"]["source"] == BUILTIN_SOURCE and "train_split" not in result.tables["data"]
    assert len(result.warnings) == 1 and "names no dataset (dataset_name)" in result.warnings[0]
    assert "dataset_config, dataset_test_split left out: the file names no dataset_name they belong to" in result.notes
    header = to_toml(result, Path("t.yaml"), "TRL", "d").splitlines()
    assert header[2] == f"# WARNING: {result.warnings[0]}"


@pytest.mark.parametrize(
    ("fields", "eval_every"),
    [
        ({"eval_steps": 25}, 25),
        ({"eval_steps": 0.1}, 20),  # a share of max_steps = 200, as the Trainer reads it
        ({"logging_steps": 40}, 40),  # eval_steps None: logging_steps, the Trainer's rule
        ({}, 10),  # TRL's logging_steps default
    ],
)
def test_eval_strategy_steps_evaluates_the_test_split(fields, eval_every):
    result = translate(**DATASET, eval_strategy="steps", **fields)
    learner = result.tables["learner"]
    assert (learner["eval_every"], learner["eval_on_start"]) == (eval_every, False)  # TRL: no evaluation at start
    assert result.tables["data"]["eval_split"] == "test"
    assert any("first learner.eval_samples (100) prompts of the 'test' split" in note for note in result.notes)
    check(result, "TRL")


def test_eval_strategy_epoch_and_the_refusals():
    epoch = translate(**DATASET, eval_strategy="epoch", dataset_test_split="validation")
    assert epoch.tables["data"]["eval_split"] == "validation"
    assert [(d.name, d.theirs) for d in epoch.differences if d.name == "eval_strategy"] == [
        ("eval_strategy", "'epoch' (after every pass over the data)")
    ]
    with pytest.raises(ValueError, match="eval_strategy = 'best' is unknown here"):
        translate(**DATASET, eval_strategy="best")
    with pytest.raises(ValueError, match=r"eval_steps = 0\.1 is a share of the run"):
        translate(dataset_name="d", num_train_epochs=1, eval_strategy="steps", eval_steps=0.1)
    with pytest.raises(ValueError, match="dataset_test_split = dataset_train_split = 'train': TRL would evaluate"):
        translate(**DATASET, eval_strategy="steps", dataset_test_split="train")
    unused = translate(**DATASET, dataset_test_split="validation")
    assert "dataset_test_split 'validation' left out: eval_strategy is 'no', as TRL's" in unused.notes


@pytest.mark.parametrize(
    ("report_to", "trackers", "ignored"),
    [
        ("none", [], []),
        ("wandb", ["wandb"], []),
        (["tensorboard", "mlflow", "wandb"], ["tensorboard", "wandb"], ["report_to 'mlflow'"]),
        ("all", ["tensorboard"], []),
    ],
)
def test_report_to_becomes_the_learners_trackers(report_to, trackers, ignored):
    result = translate(report_to=report_to)
    assert result.tables["learner"]["report_to"] == trackers
    assert list(result.no_effect) == ignored and result.unmapped == []
    assert ("report_to 'wandb': install wandb in the learner's environment" in result.notes) == ("wandb" in trackers)


def test_report_to_left_out_keeps_ours():
    """TrainingArguments' report_to 'none' changes nothing learned: an unset file keeps our TensorBoard."""
    assert "report_to" not in translate().tables["learner"]


def test_gradient_checkpointing_completion_tables_and_project():
    learner = translate(max_steps=100, log_completions=True, num_completions_to_print=4, project="p").tables["learner"]
    assert learner["gradient_checkpointing"] is True  # TRL's own default, not transformers'
    assert (learner["log_completions"], learner["num_completions_to_log"]) == (10, 4)  # every logging_steps
    assert learner["tracking_project"] == "p"
    assert translate(gradient_checkpointing=False).tables["learner"]["gradient_checkpointing"] is False
    assert "log_completions" not in translate().tables["learner"]


def test_vllm_mode_is_a_deployment_note():
    colocate = translate(use_vllm=True, vllm_mode="colocate")
    assert any(n.startswith("deployment: vllm_mode 'colocate' runs vLLM") for n in colocate.notes)
    server = translate(use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2")
    assert any("docker compose up --scale generator=" in note for note in server.notes)
    assert server.no_effect == {"vllm_server_host": TRL_NO_EFFECT["vllm_server_host"]}
    unused = translate(vllm_mode="server")
    assert any("TRL uses it only with use_vllm: true" in note for note in unused.notes)
    assert not any(n.startswith("deployment") for n in translate(use_vllm=True).notes)  # TRL's default: no note
    with pytest.raises(ValueError, match="vllm_mode = 'remote' is unknown"):
        translate(use_vllm=True, vllm_mode="remote")


def test_options_with_no_effect_are_listed_only_when_the_file_gives_them():
    given = {"push_to_hub": False, "hub_model_id": "me/m", "logging_steps": 5, "dataloader_num_workers": 4}
    result = translate(**given)
    assert result.unmapped == [] and list(result.no_effect) == sorted(given)
    assert result.no_effect["logging_steps"].startswith("metrics are written every optimizer step")
    assert translate().no_effect == {}  # TRL's defaults (logging_steps = 10) are not the file's


def test_every_no_effect_option_is_a_real_trl_option():
    """The list names options of TRL 1.16's GRPOConfig, transformers 5.19's TrainingArguments, the script's
    arguments, or (for older files) three that those releases dropped."""
    from transformers import TrainingArguments

    transformers_fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    trl_only = {
        "log_unique_prompts",
        "log_multimodal",
        "log_completions_hub_repo",
        "dataset_streaming",
        "ignore_bias_buffers",
        "ds3_gather_for_generation",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_base_url",
        "vllm_server_timeout",
        "vllm_group_port",
        "vllm_enable_sleep_mode",
        "vllm_tensor_parallel_size",
    }
    dropped = {"logging_dir", "overwrite_output_dir", "wandb_log_unique_prompts"}
    assert set(TRL_NO_EFFECT) - transformers_fields - trl_only == dropped
