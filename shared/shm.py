"""Files in a shared-memory directory (``/dev/shm``) that a CPU learner and CPU generators on one host share:
the CPU twin of CUDA IPC for weight pushes. Torch-free: the segments themselves, mapped as tensors, are
:mod:`weight_sync.transport_shm`'s.

* A generator leaves a **probe** there at start: a small file holding a random token, named in its
  registration. A learner that reads the same token at that path sees the same directory (same host, same
  IPC namespace, same user), so it pushes to that generator through shared memory instead of gloo.
* The learner packs each bucket into a **segment**: a file of the bucket's size, kept from push to push; the
  generator maps it and loads its weights straight from it (no socket, no receive copy).

A generator maps only a segment that is this user's own: a regular file (not a link) named like a segment,
owned by this process's user and writable by no other (:func:`private_file_problem`, checked by
``weight_sync.transport_shm.map_segment`` on the file it then maps).
The learner's store says where each segment lies, and whoever could write to the store - or make a file in
``/dev/shm``, which everyone can - must not get a generator to map a file of theirs or of another user.

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
import stat
import weakref
from pathlib import Path

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


def private_file_problem(info: os.stat_result) -> str | None:
    """Why a file with ``info`` is not one this user alone controls (None: it is): a regular file owned by this
    process's user, writable neither by its group nor by others."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.getuid():
        return f"is owned by uid {info.st_uid}, not this process's ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def probe_matches(path: str, token: str, directory: Path) -> bool:
    """Whether this process sees the probe ``path`` holding ``token`` in ``directory``, a file of this user's
    own (then the generator that wrote it can map the segments this process makes there)."""
    probe = Path(path)
    if probe.parent != directory or not probe.name.startswith(PROBE):
        return False
    try:  # never through a link, never blocking on a FIFO planted under the probe's name (the directory is shared)
        fd = os.open(probe, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if private_file_problem(os.fstat(fd)) is not None:
            return False
        return os.pread(fd, len(token) + 1, 0) == token.encode()
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_if_abandoned(path: Path, fd: int) -> int:
    """1 when ``path`` (open as ``fd``) was this user's own file that no live process holds, now removed; else 0.
    Another user's file, or a link or a FIFO in its place, is left alone."""
    problem = private_file_problem(os.fstat(fd))
    if problem:
        log.warning("not sweeping %s: it %s", path, problem)
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # a live process holds it
    try:
        path.unlink()
    except (FileNotFoundError, PermissionError):
        return 0
    return 1


def sweep_stale(directory: Path) -> int:
    """Remove the segments and probes in ``directory`` that no live process holds (left by a SIGKILL);
    returns how many."""
    removed = 0
    for path in directory.glob(f"{PREFIX}*"):
        if not (path.name.startswith(SEGMENT) or path.name.startswith(PROBE)):
            continue
        try:  # never through a link, never blocking on a FIFO someone left under our prefix
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            removed += _remove_if_abandoned(path, fd)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d shared-memory file(s) left in %s by processes that are gone", removed, directory)
    return removed
