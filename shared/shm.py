"""Files in a shared-memory directory (``/dev/shm``) that a CPU learner and CPU generators on one host share:
the CPU twin of CUDA IPC for weight pushes.

* A generator leaves a **probe** there at start: a small file holding a random token, named in its
  registration. A learner that reads the same token at that path sees the same directory (same host, same
  IPC namespace, same user), so it pushes to that generator through shared memory instead of gloo.
* The learner packs each bucket into a **segment**: a file of the bucket's size, kept from push to push; the
  generator maps it and loads its weights straight from it (no socket, no receive copy).

Every such file is held with a shared ``flock`` for as long as its owner lives; the lock goes with the
process, even on SIGKILL, so :func:`sweep_stale` (run when a learner starts) removes exactly the files of
processes that are gone. Space is reserved with ``posix_fallocate`` when a segment is made: a full
directory is an ``OSError`` then, never a SIGBUS while packing.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PREFIX = "asyncgrpo-"
SEGMENT = f"{PREFIX}weights-"
PROBE = f"{PREFIX}probe-"


def usable_dir(directory: str) -> Path | None:
    """``directory`` when it is a writable directory, else None (shared memory off); "" means off."""
    if not directory:
        return None
    path = Path(directory)
    return path if path.is_dir() and os.access(path, os.W_OK | os.X_OK) else None


class LockedFile:
    """A file this process made in a shared-memory directory and holds a shared lock on until ``close()``."""

    def __init__(self, directory: Path, stem: str, nbytes: int, content: bytes = b"") -> None:
        while True:
            path = directory / f"{stem}{secrets.token_hex(8)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            # A sweep between the create and the lock may have removed the name: then start again.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)
        self.path = path
        # Removed on close(), when the object is collected, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _remove, path, fd)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            if content:
                os.pwrite(fd, content, 0)
        except OSError as exc:
            self.close()
            raise OSError(
                exc.errno,
                f"no room for {nbytes / 1e6:.1f} MB in {directory} ({exc.strerror}): give it more space (Docker: "
                "shm_size, or ipc: host) or turn shared memory off (weight_shm_dir = '')",
            ) from exc

    def close(self) -> None:
        """Remove the file (processes that mapped it keep their mapping) and release the lock."""
        self._finalizer()


def _remove(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)


def make_probe(directory: Path) -> tuple[LockedFile, str]:
    """A generator's probe file and the token written in it."""
    token = secrets.token_hex(16)
    return LockedFile(directory, PROBE, 0, token.encode()), token


def probe_matches(path: str, token: str, directory: Path) -> bool:
    """Whether this process sees the probe ``path`` holding ``token`` in ``directory``, owned by this user
    (then the generator that wrote it can map the segments this process makes there)."""
    probe = Path(path)
    if probe.parent != directory or not probe.name.startswith(PROBE):
        return False
    try:
        if probe.stat().st_uid != os.getuid():
            return False
        return probe.read_bytes() == token.encode()
    except OSError:
        return False


class Segment(LockedFile):
    """A bucket's shared-memory file, mapped as a flat uint8 tensor (``tensor``) that packing writes into."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        super().__init__(directory, SEGMENT, nbytes)
        self.nbytes = nbytes
        self.tensor = map_file(self.path, nbytes)


def map_file(path: Path | str, nbytes: int) -> torch.Tensor:
    """The file at ``path`` mapped shared as ``nbytes`` uint8 (its size must be exactly that)."""
    import torch  # here: the generator's start-up decisions load without torch

    size = os.stat(path).st_size
    if size != nbytes:
        raise ValueError(f"{path} holds {size} bytes, not the {nbytes} expected")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def sweep_stale(directory: Path) -> int:
    """Remove the segments and probes in ``directory`` that no live process holds (left by a SIGKILL);
    returns how many."""
    removed = 0
    for path in directory.glob(f"{PREFIX}*"):
        if not (path.name.startswith(SEGMENT) or path.name.startswith(PROBE)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
        os.close(fd)
    if removed:
        log.warning("removed %d shared-memory file(s) left in %s by processes that are gone", removed, directory)
    return removed
