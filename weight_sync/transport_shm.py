"""The shared-memory transport, both halves: CPU generators on the learner's host (they see its shared-memory
directory, ``shared.shm``) load each bucket straight from the file the learner packed it into - no process
group to form, no socket, no receive copy.

The learner keeps one segment per bucket from push to push (:class:`ShmSegments`). Per bucket it publishes a
:class:`~shared.records.ShmBucket` (the file and its size) in the push's store namespace under
:func:`bucket_key` once the bucket is packed; each receiver answers :func:`done_key` once it has loaded it.
The push is over when every receiver is done with every bucket, so the next push may pack into the same
segments; after a push that failed, the learner makes new ones and removes the old files (a straggler keeps
what it already mapped, so it never reads the next push's bytes; a bucket it had not mapped yet is gone for
it). A push the learner gives up on (a failed gloo group beside, a packing error) is announced under
``abort`` in the namespace, so receivers waiting for a record stop at once.

A receiver maps only a segment that is this user's own (:func:`map_segment`): the learner's store says where
each segment lies, and whoever could write to the store - or make a file in ``/dev/shm``, which everyone
can - must not get a generator to map a file of theirs or of another user. The receiver
(:class:`ShmReceiver`) keeps its mappings while the learner keeps naming the same files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from shared.codec import decode, encode
from shared.records import GeneratorRegistration, ShmBucket
from shared.shm import SEGMENT, LockedFile, private_file_problem, probe_matches


def bucket_key(index: int) -> str:
    """Where the learner publishes bucket ``index``'s :class:`~shared.records.ShmBucket`."""
    return f"shm/{index}"


def done_key(index: int, receiver_id: str) -> str:
    """Where receiver ``receiver_id`` answers that it has loaded bucket ``index``."""
    return f"shm/{index}/done/{receiver_id}"


class Segment(LockedFile):
    """A bucket's shared-memory file, mapped as a flat uint8 tensor (``tensor``) that packing writes into."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        super().__init__(directory, SEGMENT, nbytes)
        self.nbytes = nbytes
        self.tensor = map_file(self.path, nbytes)


def map_file(path: Path | str, nbytes: int) -> torch.Tensor:
    """The file at ``path`` mapped shared as ``nbytes`` uint8 (its size must be exactly that)."""
    size = os.stat(path).st_size
    if size != nbytes:
        raise ValueError(f"{path} holds {size} bytes, not the {nbytes} expected")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def map_segment(path: str, nbytes: int) -> torch.Tensor:
    """The learner's segment at ``path`` mapped shared as ``nbytes`` uint8, once it is known to be one: named
    like a segment, not a link, this user's own and writable by no one else (:func:`private_file_problem`),
    of that size. The checks and the mapping are of one open file, so the name cannot be swapped between
    them. ValueError saying what is wrong otherwise."""
    if not Path(path).name.startswith(SEGMENT):
        raise ValueError(f"{path} is not a weight segment (its name does not start with {SEGMENT})")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"weight segment {path} cannot be opened ({exc.strerror}; a link is refused)") from exc
    try:
        problem = private_file_problem(os.fstat(fd))
        if problem is not None:
            raise ValueError(f"weight segment {path} {problem}: not mapped")
        return map_file(f"/proc/self/fd/{fd}", nbytes)  # the file opened and checked above, not the name again
    finally:
        os.close(fd)


def shm_receivers(directory: Path | None, generators: Sequence[GeneratorRegistration]) -> set[str]:
    """Generators whose shared-memory probe this learner sees in ``directory`` (same host, directory and user):
    they get the push through shared memory. None: shared memory is off."""
    if directory is None:
        return set()
    return {
        g.generator_id
        for g in generators
        if g.shm_probe is not None and probe_matches(g.shm_probe.path, g.shm_probe.token, directory)
    }


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
    """The learner's half: publishes packed segments in ``store`` (the push's namespace) for ``receivers``
    (generator ids)."""

    def __init__(self, store: Any, receivers: Sequence[str], segments: ShmSegments, timeout: timedelta) -> None:
        self.store, self.receivers, self.segments, self.timeout = store, list(receivers), segments, timeout
        self.published = 0

    def publish(self, index: int) -> None:
        """Bucket ``index`` is packed: tell the receivers where it lies."""
        segment = self.segments.segments[index]
        self.store.set(
            bucket_key(index), encode(ShmBucket(bucket=index, path=str(segment.path), nbytes=segment.nbytes))
        )
        self.published = max(self.published, index + 1)

    def finish(self) -> None:
        """Wait until every receiver has loaded every bucket; raises TimeoutError naming those that have not."""
        keys = [done_key(i, gid) for i in range(self.published) for gid in self.receivers]
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


class ShmReceiver:
    """A generator worker's half: the learner's segments, mapped once and kept while the learner keeps
    packing into them (it says so by naming the same files push after push)."""

    def __init__(self) -> None:
        self.maps: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()  # the paths the push being received named

    def bucket(self, published: Callable[[str], bytes], index: int, nbytes: int) -> torch.Tensor:
        """Bucket ``index`` where the learner packed it; ``published`` waits for a record in the store."""
        record = decode(published(bucket_key(index)), ShmBucket)
        if record.nbytes != nbytes:
            raise RuntimeError(f"shared-memory bucket {index} is {record.nbytes} bytes; the layout says {nbytes}")
        mapped = self.maps.get(record.path)
        if mapped is None:
            try:  # only a segment of this user's own, writable by no one else, is mapped
                mapped = self.maps[record.path] = map_segment(record.path, nbytes)
            except ValueError as exc:
                raise RuntimeError(f"shared-memory bucket {index}: {exc}") from exc
        self.used.add(record.path)
        return mapped

    @staticmethod
    def release(store: Any, index: int, receiver_id: str) -> None:
        """Tell the learner this worker is done with bucket ``index``."""
        store.set(done_key(index, receiver_id), b"1")

    def forget_unused(self) -> None:
        """Unmap the segments the last push did not name (the learner made new ones)."""
        self.maps = {path: t for path, t in self.maps.items() if path in self.used}
        self.used = set()
