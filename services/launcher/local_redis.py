"""A local ``redis-server`` for the launcher (when no Redis answers) and for tests (never a fake Redis).

:func:`use_or_start_redis` is the one "use ``$REDIS_URL`` or start a Redis" that the tests' Redis fixture and
the benchmarks share; :func:`redis_for_run` is ``asyncgrpo run``'s, which uses only a Redis it is named, refuses
one without a password unless told otherwise, and else starts one with a password and one ACL user per service
(:mod:`shared.redis_acl`), the passwords made for the run and given on redis-server's standard input.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from shared.config.base import mask_url
from shared.keys import Keys
from shared.redis_acl import ROLES, config_lines, config_quoted, service_url

DEFAULT_URL = "redis://127.0.0.1:6379/0"

log = logging.getLogger(__name__)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different ports free on this machine now (each held until all are picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def answers(url: str, timeout_s: float = 1.0) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


@dataclass
class RedisServer:
    """A redis-server process we started; only this pid is ever stopped."""

    port: int
    directory: Path
    process: subprocess.Popen | None = None
    appendonly: bool = False
    password: str = ""
    tls: tuple[str, str, str] | None = None  # (certificate, key, CA) files: the server then speaks TLS only
    acl: list[str] = field(default_factory=list)  # ``user`` config lines (shared.redis_acl.config_lines)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls[2]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _arguments(self, binary: str) -> list[str]:
        args = [binary, "--bind", "127.0.0.1", "--dir", str(self.directory), "--save", ""]
        args += ["--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always"]
        args += ["--logfile", str(self.directory / "redis.log")]
        args += _tls_arguments(self.port, self.tls) if self.tls else ["--port", str(self.port)]
        return args

    def _secret_config(self) -> bytes:
        """The configuration that holds passwords, given on standard input (``redis-server -``), never on the
        command line, which every local user can read (``/proc/<pid>/cmdline``, ``ps``)."""
        lines = [f"requirepass {config_quoted(self.password)}"] if self.password else []
        return "".join(f"{line}\n" for line in [*lines, *self.acl]).encode()

    def start(self, timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; install Redis 7 (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [binary, "-", *self._arguments(binary)[1:]],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        assert self.process.stdin is not None  # stdin=PIPE
        with self.process.stdin:
            self.process.stdin.write(self._secret_config())
        deadline = time.monotonic() + timeout_s
        while not answers(self.url, 0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start; see {self.directory}/redis.log")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def _tls_arguments(port: int, tls: tuple[str, str, str]) -> list[str]:
    """TLS only: the plain port off, the TLS port on, clients not asked for certificates."""
    cert, key, ca = tls
    return [
        *("--port", "0", "--tls-port", str(port)),
        *("--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca),
        *("--tls-auth-clients", "no"),
    ]


def start_redis(
    appendonly: bool = False,
    *,
    password: str = "",
    tls: tuple[str, str, str] | None = None,
    acl: list[str] | None = None,
) -> RedisServer:
    """A redis-server on a free port (with a password, or TLS from (certificate, key, CA) files, if given;
    ``acl``: users besides the default one, as ``user`` config lines). Passwords reach the server on its
    standard input, never its command line."""
    server = RedisServer(
        port=free_port(),
        directory=Path(tempfile.mkdtemp(prefix="redis-test-")),
        appendonly=appendonly,
        password=password,
        tls=tls,
        acl=list(acl or ()),
    )
    server.start()
    return server


def use_or_start_redis(url: str | None = None) -> tuple[str, RedisServer | None]:
    """The Redis at ``url`` (default ``$REDIS_URL``, else the local default port) if it answers; otherwise a
    redis-server started on a free port. Returns the URL to use and the server started (None: none was),
    which the caller stops."""
    url = url or os.environ.get("REDIS_URL", DEFAULT_URL)
    if answers(url):
        log.info("using the Redis at %s", mask_url(url))
        return url, None
    server = start_redis()
    log.info("no Redis at %s; started redis-server on port %d", mask_url(url), server.port)
    return server.url, server


class RedisWithoutAuth(RuntimeError):
    """The Redis named for a run takes commands from anyone without a password, and that was not allowed."""


def takes_commands_without_auth(url: str) -> bool:
    """Whether the Redis at ``url`` answers a client that gives no user and no password (its default user is
    ``nopass``): then anyone who reaches it can read and rewrite the run."""
    parts = urlsplit(url)
    anonymous = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    client = redis.Redis.from_url(anonymous, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        return bool(client.ping())
    except redis.AuthenticationError:
        return False
    except redis.ResponseError as exc:  # NOAUTH
        if "NOAUTH" in str(exc) or "Authentication required" in str(exc):
            return False
        raise
    finally:
        client.close()


def redis_for_run(
    prefix: str, url: str | None = None, *, allow_no_auth: bool | None = None
) -> tuple[dict[str, str], RedisServer | None]:
    """Each service's ``REDIS_URL`` for one ``asyncgrpo run`` with key prefix ``prefix``, as the variables
    ``GENERATOR_REDIS_URL``, ``SCORER_REDIS_URL`` and ``LEARNER_REDIS_URL``, and the server started (None: none).

    A Redis is used only when it is named (``url``, else ``$REDIS_URL``) and answers: it is the operator's, every
    service gets that URL and its users are the operator's to make. One that takes commands without a password
    (:func:`takes_commands_without_auth`) is refused (:class:`RedisWithoutAuth`) unless ``allow_no_auth``
    (``[launcher] redis_allow_no_auth``), and then said in a warning at every start; ``None``: allowed with that
    warning (a caller that does not pass the setting). Otherwise (nothing named, or nothing answering there) a
    redis-server is started here with one ACL user per service (:mod:`shared.redis_acl`) and passwords made for
    this run, whatever answers on the default port; its default user, the administrator, gets a password of its
    own that no service is given."""
    url = url or os.environ.get("REDIS_URL")
    if url and answers(url):
        _check_auth(url, allow_no_auth)
        log.info("using the Redis at %s (its users: each service logs in as that URL says)", mask_url(url))
        return {_variable(role): url for role in ROLES}, None
    passwords = {role: secrets.token_urlsafe(32) for role in ROLES}
    server = start_redis(password=secrets.token_urlsafe(32), acl=config_lines(passwords, Keys(prefix)))
    where = f"no Redis at {mask_url(url)}" if url else "no Redis named ($REDIS_URL)"
    log.info("%s; started redis-server on port %d with a password, one user per service", where, server.port)
    return {_variable(role): service_url(server.url, role, passwords[role]) for role in ROLES}, server


def _check_auth(url: str, allow_no_auth: bool | None) -> None:
    """Refuse, or warn about, a named Redis that anyone can use without a password (see :func:`redis_for_run`)."""
    if not takes_commands_without_auth(url):
        return
    if allow_no_auth is False:
        raise RedisWithoutAuth(
            f"the Redis at {mask_url(url)} takes commands without a password: anyone who reaches it can read and "
            "rewrite the run. Give it a password and ACL users (python -m shared.redis_acl), leave REDIS_URL unset "
            "so that asyncgrpo run starts its own, or set [launcher] redis_allow_no_auth = true"
        )
    log.warning(
        "the Redis at %s takes commands without a password (redis_allow_no_auth): anyone who reaches it can read "
        "and rewrite this run",
        mask_url(url),
    )


def _variable(role: str) -> str:
    """The prefixed variable that sets ``redis_url`` for one service alone (it wins over ``REDIS_URL``)."""
    return f"{role.upper()}_REDIS_URL"
