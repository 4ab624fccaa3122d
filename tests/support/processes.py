"""Start service processes for tests and stop exactly the pids we started (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    lines: deque = field(default_factory=lambda: deque(maxlen=400))
    port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, needle: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.output()[-6000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not print {needle!r} in {timeout_s} s:\n{self.output()[-6000:]}")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL this process, its process group (vLLM's engine core and workers) and every descendant
        (torchrun starts its ranks in sessions of their own)."""
        if self.process.poll() is None:
            import psutil

            try:
                descendants = psutil.Process(self.process.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                descendants = []
            os.killpg(self.process.pid, signal.SIGKILL)
            for child in descendants:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            self.process.wait()


def start_service(
    name: str, module: str, env: dict[str, str], args: list[str] | None = None, cwd: Path = ROOT
) -> ServiceProcess:
    """``python -m module args`` with this interpreter, in ``cwd`` (the repository by default)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    process = subprocess.Popen(
        [sys.executable, "-m", module, *(args or [])],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so kill() takes the engine's children too
    )
    service = ServiceProcess(name, process)

    def pump() -> None:
        for line in process.stdout:
            service.lines.append(line)
            if os.environ.get("ASYNCGRPO_TEST_ECHO"):
                sys.stderr.write(f"[{name}] {line}")

    threading.Thread(target=pump, daemon=True).start()
    return service


def wait_http_ok(url: str, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            reply = httpx.get(url, timeout=2)
            if reply.status_code == 200:
                return reply
            last = reply.text
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.3)
    raise TimeoutError(f"{url} not OK after {timeout_s} s: {last}")


def require_current_setup() -> None:
    """Fail with the fix when ``make <target>`` would set the project up again first (the lock or
    pyproject.toml changed since .venv was made): that would rebuild the very .venv a test runs from."""
    stale = subprocess.run(["make", "-C", str(ROOT), "-q", ".venv/.installed"], capture_output=True).returncode
    if stale:
        import pytest

        pytest.fail("the project's .venv is older than the lock or pyproject.toml: run `make setup` first")
