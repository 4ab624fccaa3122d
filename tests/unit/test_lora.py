"""LoRA (``lora_rank > 0``): only the adapters train; pushes and checkpoints carry the merged weights
under the base model's names, which transformers loads."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from services.learner.checkpoint import LearnerState, save_checkpoint
from services.learner.data.batch import collate
from services.learner.model import load_policy
from services.learner.trainer import Trainer
from shared.config.learner import LearnerSettings
from tests.support.factories import make_task
from tests.support.fake_pipeline import scored_group_for
from tests.support.tiny_model import build_tiny_llama


def test_lora_trains_adapters_only_and_pushes_merged_weights(tmp_path):
    tiny = build_tiny_llama(tmp_path / "m", seed=1, logit_scale=1.0)
    settings = LearnerSettings(
        model=str(tiny),
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=["q_proj", "v_proj"],
        group_size=4,
        groups_per_step=2,
        micro_batch_size=4,
        lr=1e-2,
        max_completion_length=32,
    )
    model, tokenizer = load_policy(settings, str(tiny))
    base = model.get_base_model()
    before = {n: p.detach().clone() for n, p in base.named_parameters() if "lora_" not in n}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    groups = [scored_group_for(make_task(group_size=4, task_id=f"lora-{i}"), version=0) for i in range(2)]
    batch = collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4)
    trainer = Trainer(model, settings)
    trainer.train(batch)

    for name, param in base.named_parameters():
        if "lora_" not in name:
            torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=0)  # frozen
    layer = base.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach() * layer.scaling["default"]
    assert float(delta.abs().max()) > 1e-4, "the adapters did not train"

    q_name = "model.layers.0.self_attn.q_proj.weight"
    with trainer.export.full_weights() as named:
        weights = {name: tensor.clone() for name, tensor in named}
    assert set(weights) == {n.replace(".base_layer", "") for n in before}
    # The linear weights as the push names them (to travel transposed to CPU engines): the merged ones.
    linear = trainer.export.linear_weights
    assert q_name in linear and "model.layers.0.mlp.down_proj.weight" in linear
    assert linear <= set(weights) and "model.embed_tokens.weight" not in linear
    q_base = before["model.layers.0.self_attn.q_proj.base_layer.weight"]
    torch.testing.assert_close(weights[q_name], q_base + delta)
    torch.testing.assert_close(weights["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    # Unmerged again after the push: the base weights are the frozen ones.
    torch.testing.assert_close(layer.base_layer.weight.detach(), q_base)

    path = save_checkpoint(tmp_path / "ckpt", trainer, tokenizer, LearnerState(step=1, policy_version=1), keep=1)
    assert (path / "adapter").is_dir()
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(dict(reloaded.named_parameters())[q_name].detach(), weights[q_name])


def test_lora_under_bf16_compute_trains_float32_adapters_over_a_bf16_base(tmp_path):
    tiny = build_tiny_llama(tmp_path / "m", seed=1, logit_scale=1.0)
    settings = LearnerSettings(
        model=str(tiny),
        compute_dtype="bfloat16",
        lora_rank=4,
        lora_target_modules=["q_proj", "v_proj"],
        group_size=4,
        groups_per_step=2,
        micro_batch_size=4,
        lr=1e-2,
        max_completion_length=16,
    )
    model, _ = load_policy(settings, str(tiny))
    base = model.get_base_model()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if "lora_" not in n}
    assert all(t.dtype == torch.bfloat16 for t in frozen.values())

    groups = [scored_group_for(make_task(group_size=4, task_id=f"lora-bf16-{i}"), version=0) for i in range(2)]
    trainer = Trainer(model, settings)
    trainer.train(collate(groups, [torch.from_numpy(g.advantages.copy()) for g in groups], pad_id=4))
    layer = base.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach() * layer.scaling["default"]
    assert float(delta.abs().max()) > 1e-4, "the adapters did not train"

    q_base = frozen["model.layers.0.self_attn.q_proj.base_layer.weight"]
    for _ in range(3):  # pushes never round the frozen base: nothing is merged into it in place
        with trainer.export.full_weights() as named:
            weights = dict(named)
        torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], q_base.float() + delta)
    for name, param in base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param.detach(), frozen[name]), name
