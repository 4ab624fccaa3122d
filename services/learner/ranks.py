"""The torchrun command channel: the leader's commands to the other ranks, and a follower's life running them.

Every rank must enter the same collectives in the same order (FSDP2 gathers and reduces over all of them), so
the leader announces each thing it does that involves the others, in the order it does it: train this batch,
gather the full weights (a push or a checkpoint), save the optimizer's shards, stop. On one process, and on a
follower, sending is a no-op. See :mod:`services.learner.distributed` for the rest of the multi-rank story.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.learner.distributed import Topology, full_weights, save_optimizer

log = logging.getLogger(__name__)


class RankChannel:
    """The leader's commands to the other ranks, in order (a broadcast from rank 0)."""

    TRAIN, WEIGHTS, SAVE_OPTIMIZER, STOP = "train", "weights", "save_optimizer", "stop"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.stopped = False

    def send(self, command: str, payload: Any = None) -> None:
        if self.topology.distributed and self.topology.is_leader and not self.stopped:
            dist.broadcast_object_list([(command, payload)], src=0)
            self.stopped = command == self.STOP

    def receive(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def train(self, batch) -> None:
        """Train this batch (the whole of it, on the CPU: every rank takes its rows)."""
        self.send(self.TRAIN, batch.to(torch.device("cpu")))

    def gather_weights(self) -> None:
        self.send(self.WEIGHTS)

    def save_optimizer(self, path: Path) -> None:
        self.send(self.SAVE_OPTIMIZER, str(path))

    def stop(self) -> None:
        self.send(self.STOP)


def follow(trainer) -> int:
    """A follower's life: run the leader's commands until it says stop; returns optimizer steps taken."""
    channel = trainer.ranks
    while True:
        command, payload = channel.receive()
        if command == RankChannel.TRAIN:
            trainer.train_shard(payload)
        elif command == RankChannel.WEIGHTS:
            with full_weights(trainer.model):
                pass
        elif command == RankChannel.SAVE_OPTIMIZER:
            save_optimizer(trainer.model, trainer.optimizer.adamw, Path(payload))
        elif command == RankChannel.STOP:
            log.info("rank %d: the leader said stop at step %d", channel.topology.rank, trainer.step)
            return trainer.step
        else:
            raise RuntimeError(f"unknown command from the leader: {command!r}")
