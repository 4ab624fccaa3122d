"""The learner's half of the shared-memory transport: CPU generators on the learner's host (they see its
shared-memory directory, ``shared.shm``) load each bucket straight from the file the learner packed it into -
no process group to form, no socket, no receive copy.

The learner keeps one segment per bucket from push to push (:class:`ShmSegments`). Per bucket it publishes a
:class:`~shared.records.ShmBucket` (the file and its size) in the push's store namespace under ``shm/<bucket>``
once the bucket is packed; each receiver answers ``shm/<bucket>/done/<id>`` once it has loaded it. The push
is over when every receiver is done with every bucket, so the next push may pack into the same segments; after
a push that failed, the learner makes new ones and removes the old files (a straggler keeps what it already
mapped, so it never reads the next push's bytes; a bucket it had not mapped yet is gone for it). A push the
learner gives up on (a failed gloo group beside, a packing error) is announced under ``abort`` in the
namespace, so receivers waiting for a record stop at once.

The receiving half is ``WeightReceiverExtension`` in :mod:`services.generator.weight_receiver`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from shared.codec import encode
from shared.records import ShmBucket
from shared.shm import Segment


class ShmSegments:
    """One shared-memory segment per bucket of one layout (``sizes`` bytes each)."""

    def __init__(self, directory: Path, sizes: Sequence[int]) -> None:
        self.segments: list[Segment] = []
        try:
            for nbytes in sizes:
                self.segments.append(Segment(directory, nbytes))
        except BaseException:
            self.close()
            raise

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [segment.tensor for segment in self.segments]

    def close(self) -> None:
        for segment in self.segments:
            segment.close()


class ShmPublisher:
    """Publishes packed segments in ``store`` (the push's namespace) for ``receivers`` (generator ids)."""

    def __init__(self, store: Any, receivers: Sequence[str], segments: ShmSegments, timeout: timedelta) -> None:
        self.store, self.receivers, self.segments, self.timeout = store, list(receivers), segments, timeout
        self.published = 0

    def publish(self, index: int) -> None:
        """Bucket ``index`` is packed: tell the receivers where it lies."""
        segment = self.segments.segments[index]
        self.store.set(f"shm/{index}", encode(ShmBucket(bucket=index, path=str(segment.path), nbytes=segment.nbytes)))
        self.published = max(self.published, index + 1)

    def finish(self) -> None:
        """Wait until every receiver has loaded every bucket; raises TimeoutError naming those that have not."""
        keys = [f"shm/{i}/done/{gid}" for i in range(self.published) for gid in self.receivers]
        if not keys:
            return
        try:
            self.store.wait(keys, self.timeout)
        except torch.distributed.DistStoreError as exc:  # the wait timed out
            late = sorted({key.rpartition("/")[2] for key in keys if not self.store.check([key])})
            raise TimeoutError(
                f"generator(s) {', '.join(late)} did not load every shared-memory bucket within "
                f"{self.timeout.total_seconds():.0f} s"
            ) from exc
