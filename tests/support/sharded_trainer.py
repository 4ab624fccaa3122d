"""Run under torchrun: the learner's sharded Trainer on batches saved by a test.

    torchrun --standalone --nproc_per_node 2 tests/support/sharded_trainer.py --model M --batches B.pt
        --settings JSON --out DIR [--weights W.pt] [--resume DIR] [--dtype float64|float32]

Every rank loads the model (in float64 by default, so the comparison with one process is exact to rounding;
in float32 for the mixed-precision test, computing in the settings' compute dtype), keeps a frozen copy as
the reference model (in the compute dtype when it is lower), replaces its weights with ``--weights`` when
given, shards it with FSDP2 and builds the Trainer; with ``--resume`` it restores the trainer state and
optimizer shards a previous run saved. The leader trains each batch (the others follow its commands, as in
the service), then saves the trainer state and optimizer shards to ``DIR/state``, the full weights to
``DIR/weights.pt`` and the per-step metrics to ``DIR/metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.learner import distributed, ranks
from services.learner.hardware import Precision, resolve_precision
from services.learner.model import reference_model
from services.learner.trainer import Trainer
from shared.config.learner import LearnerSettings


def build(
    model_path: str, weights: str | None, settings: LearnerSettings, topology, dtype: torch.dtype = torch.float64
) -> Trainer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    compute = resolve_precision(settings.param_dtype, settings.compute_dtype, settings.device).compute
    compute = compute if Precision(param=dtype, compute=compute).mixed else dtype  # float64 stays float64
    # The reference is the initial model, as the service's.
    reference = reference_model(model, compute) if settings.beta > 0 else None
    if weights:
        missing, unexpected = model.load_state_dict(torch.load(weights), strict=False)
        assert not unexpected and all(name.endswith("rotary_emb.inv_freq") for name in missing), missing
    if topology.distributed:
        distributed.shard_model(model, compute)
    return Trainer(model, settings, reference, topology)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", required=True)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--weights")
    parser.add_argument("--resume")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    args = parser.parse_args()
    topology = distributed.topology_from_env()
    distributed.start(topology, "cpu")
    settings = LearnerSettings(**json.loads(args.settings))
    trainer = build(args.model, args.weights, settings, topology, getattr(torch, args.dtype))
    if args.resume:
        trainer.load_state_dict(torch.load(Path(args.resume) / "trainer.pt", weights_only=False), Path(args.resume))
    if not topology.is_leader:
        ranks.follow(trainer)
        distributed.stop()
        return 0
    out = Path(args.out)
    metrics = []
    for batch in torch.load(args.batches, weights_only=False):
        metrics += trainer.train(batch)
    (out / "state").mkdir(parents=True, exist_ok=True)
    trainer.save_optimizer(out / "state" / "optimizer")
    torch.save(trainer.state_dict(), out / "state" / "trainer.pt")
    with trainer.export.full_weights() as named:
        torch.save({name: tensor.clone() for name, tensor in named}, out / "weights.pt")
    trainer.stop_followers()
    distributed.stop()
    (out / "metrics.json").write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    # As the service: a finished rank skips interpreter finalization, where the gloo group FSDP's mesh keeps
    # alive can abort it ("terminate called without an active exception"; seen in CI on rank 0 of this script).
    distributed.exit_process(main())
