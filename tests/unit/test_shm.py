"""Shared-memory files of CPU weight pushes (``shared.shm``, ``weight_sync.transport_shm``): probes,
segments, their removal, and the sweep of files whose owner is gone - on a real tmpfs (/dev/shm) where the
test needs its limits, else tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import shared.shm
from shared.shm import (
    PROBE,
    SEGMENT,
    LockedFile,
    make_probe,
    probe_matches,
    sweep_stale,
    usable_dir,
)
from weight_sync.transport_shm import Segment, map_file, map_segment


def test_usable_dir_is_a_writable_directory_or_none(tmp_path):
    assert usable_dir(str(tmp_path)) == tmp_path
    assert usable_dir("") is None
    assert usable_dir(str(tmp_path / "missing")) is None
    (tmp_path / "file").write_text("x")
    assert usable_dir(str(tmp_path / "file")) is None


def test_a_segment_is_a_shared_mapping_of_its_file(tmp_path):
    segment = Segment(tmp_path, 1 << 16)
    assert segment.path.name.startswith(SEGMENT) and segment.path.stat().st_size == 1 << 16
    assert segment.path.stat().st_mode & 0o777 == 0o600
    segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    other = map_file(segment.path, 1 << 16)  # what a generator maps: the same memory
    assert other[:4].tolist() == [1, 2, 3, 4]
    other[4] = 9
    assert int(segment.tensor[4]) == 9
    with pytest.raises(ValueError, match="holds 65536 bytes, not the 100 expected"):
        map_file(segment.path, 100)
    segment.close()
    assert not segment.path.exists()
    assert other[:5].tolist() == [1, 2, 3, 4, 9]  # a mapping outlives the file's name
    segment.close()  # twice is fine


def test_a_full_directory_is_a_clear_error_not_a_sigbus():
    shm = Path("/dev/shm")
    if usable_dir(str(shm)) is None:
        pytest.skip("no writable /dev/shm")
    free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    before = set(shm.glob(f"{SEGMENT}*"))
    with pytest.raises(OSError, match=r"no room for .* MB in /dev/shm .*shm_size.*weight_shm_dir = ''"):
        Segment(shm, free + (1 << 30))
    assert set(shm.glob(f"{SEGMENT}*")) == before  # the half-made file is gone


def test_probes_match_only_their_token_directory_and_name(tmp_path):
    probe, token = make_probe(tmp_path)
    assert probe.path.name.startswith(PROBE) and len(token) == 32
    assert probe_matches(str(probe.path), token, tmp_path)
    assert not probe_matches(str(probe.path), "0" * 32, tmp_path)
    assert not probe_matches(str(probe.path), token, tmp_path / "elsewhere")
    impostor = tmp_path / "not-a-probe"
    impostor.write_text(token)
    assert not probe_matches(str(impostor), token, tmp_path)
    probe.close()
    assert not probe_matches(str(probe.path), token, tmp_path)


def test_a_fifo_or_a_link_planted_as_a_probe_is_refused_at_once(tmp_path):
    """The probe's directory (default /dev/shm) is writable by anyone: a FIFO under a probe's name must not block
    the learner that checks it (an open without O_NONBLOCK waits for a writer forever), nor a link lead it to a
    file of this user's that holds the token."""
    token = "a" * 32
    fifo = tmp_path / f"{PROBE}fifo"
    os.mkfifo(fifo)
    answer: list[bool] = []
    checking = threading.Thread(target=lambda: answer.append(probe_matches(str(fifo), token, tmp_path)), daemon=True)
    checking.start()
    checking.join(5)
    blocked = checking.is_alive()
    if blocked:  # in open(), waiting for a writer: let it go (a writer's open ends the wait) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        checking.join(5)
    assert not blocked, "probe_matches blocked on a FIFO"
    assert answer == [False]
    target = tmp_path / "real"
    target.write_text(token)
    link = tmp_path / f"{PROBE}link"
    link.symlink_to(target)
    assert not probe_matches(str(link), token, tmp_path)


def test_a_generator_maps_only_a_segment_of_its_own_user_that_no_one_else_can_write(tmp_path, monkeypatch):
    """The learner's store names each segment's path; a name is not enough: whoever can write to the store or
    make a file in /dev/shm (everyone) must not get a generator to map a file of theirs."""
    segment = Segment(tmp_path, 4096)
    segment.tensor[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    mapped = map_segment(str(segment.path), 4096)
    assert mapped[:3].tolist() == [7, 8, 9]
    segment.tensor[3] = 5
    assert int(mapped[3]) == 5  # the same memory

    def made(name: str, mode: int = 0o600) -> str:
        path = tmp_path / name
        path.write_bytes(bytes(4096))
        path.chmod(mode)
        return str(path)

    with pytest.raises(ValueError, match="not a weight segment"):
        map_segment(made("not-a-segment"), 4096)
    with pytest.raises(ValueError, match="writable by its group or others \\(mode 666\\)"):
        map_segment(made(f"{SEGMENT}loose", 0o666), 4096)
    with pytest.raises(ValueError, match="writable by its group or others"):
        map_segment(made(f"{SEGMENT}group", 0o620), 4096)
    link = tmp_path / f"{SEGMENT}link"
    link.symlink_to(segment.path)
    with pytest.raises(ValueError, match="a link is refused"):
        map_segment(str(link), 4096)
    (tmp_path / f"{SEGMENT}dir").mkdir()
    with pytest.raises(ValueError, match="cannot be opened"):
        map_segment(str(tmp_path / f"{SEGMENT}dir"), 4096)
    with pytest.raises(ValueError, match="holds 4096 bytes, not the 100 expected"):
        map_segment(str(segment.path), 100)
    owner = os.getuid()
    monkeypatch.setattr(shared.shm.os, "getuid", lambda: owner + 1)  # as if another user had made it
    with pytest.raises(ValueError, match=f"is owned by uid {owner}, not this process's"):
        map_segment(str(segment.path), 4096)
    monkeypatch.undo()
    segment.close()


def test_a_probe_writable_by_others_does_not_count(tmp_path):
    probe, token = make_probe(tmp_path)
    assert probe_matches(str(probe.path), token, tmp_path)
    probe.path.chmod(0o666)
    assert not probe_matches(str(probe.path), token, tmp_path)
    probe.close()


HOLD = """
import sys, time
from pathlib import Path
from shared.shm import make_probe
from weight_sync.transport_shm import Segment
segment = Segment(Path(sys.argv[1]), 4096)
probe, _ = make_probe(Path(sys.argv[1]))
print(segment.path, probe.path, flush=True)
time.sleep(600)
"""


def test_the_sweep_removes_exactly_the_files_of_processes_that_are_gone(tmp_path):
    held = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    dead = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        held_files = [Path(p) for p in held.stdout.readline().split()]
        dead_files = [Path(p) for p in dead.stdout.readline().split()]
        dead.kill()  # SIGKILL: no clean-up ran
        dead.wait()
        mine = LockedFile(tmp_path, SEGMENT, 16)
        unrelated = tmp_path / "someone-elses-file"
        unrelated.write_text("x")
        assert all(p.exists() for p in dead_files)
        assert sweep_stale(tmp_path) == 2
        assert not any(p.exists() for p in dead_files)
        assert all(p.exists() for p in [*held_files, mine.path, unrelated])
        mine.close()
    finally:
        held.kill()
        held.wait()
    assert sweep_stale(tmp_path) == 2 and [p.name for p in tmp_path.iterdir()] == ["someone-elses-file"]


def test_the_sweep_leaves_links_fifos_and_other_users_files_alone(tmp_path):
    """A local user may plant anything under our prefix in a shared /dev/shm: the sweep neither hangs on a FIFO,
    follows a link, nor fails on a file it may not remove."""
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (tmp_path / "asyncgrpo-weights-link").symlink_to(target)
    os.mkfifo(tmp_path / "asyncgrpo-weights-fifo")
    foreign = tmp_path / "asyncgrpo-probe-foreign"
    foreign.write_bytes(b"x")
    if os.getuid() == 0:
        os.chown(foreign, 4242, 4242)  # another user's (needs root to make one here)
    writable = tmp_path / "asyncgrpo-weights-shared"
    writable.write_bytes(b"x")
    writable.chmod(0o666)
    assert sweep_stale(tmp_path) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "asyncgrpo-probe-foreign",
        "asyncgrpo-weights-fifo",
        "asyncgrpo-weights-link",
        "asyncgrpo-weights-shared",
        "precious",
    ]
    assert target.read_bytes() == b"keep"
