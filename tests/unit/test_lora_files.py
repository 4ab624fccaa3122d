"""The PEFT directory a pushed adapter becomes (weight_sync/lora_files.py): its config, the names it accepts,
owner-only files that PEFT reads back."""

from __future__ import annotations

import json
import stat

import pytest
import torch

from weight_sync.lora_files import CONFIG_FILE, WEIGHTS_FILE, adapter_problem, peft_config, write_adapter

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def test_config_is_plain_lora():
    config = peft_config(8, 16.0, ["v_proj", "q_proj"])
    assert config["r"] == 8 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert (config["peft_type"], config["use_rslora"], config["use_dora"]) == ("LORA", False, False)


def test_config_refuses_what_is_no_adapter():
    with pytest.raises(ValueError, match="lora_rank >= 1"):
        peft_config(0, 16.0, ["q_proj"])
    with pytest.raises(ValueError, match="lora_target_modules"):
        peft_config(4, 16.0, [])


def test_adapter_problem_names_the_fault():
    assert adapter_problem([A, B]) is None
    assert adapter_problem([]) == "no tensors"
    assert adapter_problem([A]) == "unpaired LoRA weights: base_model.model.model.layers.0.self_attn.q_proj"
    assert "model.norm.weight" in adapter_problem([A, B, "model.norm.weight"])


def test_written_adapter_is_private_and_reads_back(tmp_path):
    from safetensors.torch import load_file

    tensors = {A: torch.randn(4, 16), B: torch.randn(16, 4)}
    written = write_adapter(tmp_path / "adapters" / "policy-v3-1", tensors, peft_config(4, 8.0, ["q_proj"]))
    assert stat.S_IMODE(written.stat().st_mode) == 0o700
    assert json.loads((written / CONFIG_FILE).read_text())["r"] == 4
    back = load_file(str(written / WEIGHTS_FILE))
    assert set(back) == {A, B} and all(torch.equal(back[n], tensors[n]) for n in tensors)
    with pytest.raises(FileExistsError):
        write_adapter(written, tensors, peft_config(4, 8.0, ["q_proj"]))


def test_peft_reads_the_config():
    from peft import LoraConfig

    config = LoraConfig(**{k: v for k, v in peft_config(4, 8.0, ["q_proj"]).items() if k != "peft_type"})
    assert config.r == 4 and config.lora_alpha == 8.0
