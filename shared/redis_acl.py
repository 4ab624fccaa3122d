"""Least privilege in Redis: one ACL user per service, allowed only the commands and keys it uses.

Anyone who can write to Redis can steer a run: register a generator URL the learner then sends its API token
to, or put groups of their own in the scored stream. So each service logs in as its own user (``generator``,
``scorer``, ``learner``), and Redis refuses it every command and key it does not need: a scorer cannot
register a generator, a generator cannot write scored groups, none of them can run ``FLUSHALL``, ``CONFIG``
or ``KEYS``. The default user stays the administrator (``REDIS_PASSWORD``: operators, health checks).

This module is the one definition. ``docker-compose.yml`` and ``deploy/k8s/redis.yaml`` carry its rules as
``user`` lines of redis-server's configuration on its standard input, passwords filled in by the container's
shell, never on a command line (``python -m shared.redis_acl compose|k8s`` prints the script; a test checks
that the committed files say the same and runs it), ``asyncgrpo run`` starts its own Redis with them the same
way, and ``python -m shared.redis_acl table`` prints the documentation table.

Key patterns are the names of :class:`shared.keys.Keys` with the variable part as ``*``. Each pattern is one
Redis 7 ACL selector: its access (``RW`` ``~``, read only ``%R~`` or write only ``%W~``, as Redis checks it from
each command's key specification) and the only commands the service runs there. So a command is refused on
every key it is not granted on: a generator may ``SET`` its registration but not the prompts stream, ``XADD`` its
rollouts but not ``XTRIM`` them, and no user may ``RENAME``, ``COPY``, ``RESTORE``, ``XDEL``,
``XGROUP DESTROY|SETID|DELCONSUMER`` or ``FCALL`` anything, ``EXPIRE`` anything but its applied markers, nor
``DEL`` anything but a generator its registration and the GPU leases. Streams are trimmed by the learner alone (the
entries every group has finished, ``XTRIM MINID``), so no producer can cut what its consumers have not read.
ACL cannot bound ``XTRIM``'s arguments, so the learner could cut unread entries too: it is the run's trust
root already (it writes the weights every generator loads), so its retention adds no power it lacks.
A generator may write registrations (``SET``, ``DEL``) under any name of ``Keys.registration``'s pattern and
append to their index (``RPUSH``), but run no command that reads the index, another's registration or the
key space: it can name only its own registration, whose name holds its secret (``shared.registry``).
``EVAL`` is granted only on the keys its scripts name, and Redis checks every command inside a script against
the same grants, so a script can do nothing its user could not do one command at a time.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

from shared.keys import Keys

ROLES = ("generator", "scorer", "learner")
Access = Literal["RW", "R", "W"]
_ACCESS_PREFIX = {"RW": "~", "R": "%R~", "W": "%W~"}
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_VARIABLE = "\0"  # stands for the variable part of a key name while its pattern is made

# Commands no key is named in, allowed to every user: its connection and transactions (WATCH names keys, so it
# is granted with the keys it watches). Not CLIENT SETINFO, which redis-py sends on connecting and does without
# (and Redis 7.0 does not know: a rule naming it would stop the server).
KEYLESS = ("ping", "select", "multi", "exec", "discard", "unwatch")  # select: the database number of REDIS_URL
# Commands by what they serve, each granted only on the keys it serves (one ACL selector per key pattern).
CONSUMER = ("xgroup|create", "xreadgroup", "xautoclaim", "xclaim", "xpending", "xack", "eval", "xinfo|groups", "xlen")
# A commit checks its applied marker under WATCH and makes it with INCRBY (redis-py's incr) and EXPIRE: no command
# granted there takes a value, so a marker holds an integer (at most 20 bytes), whatever its user sends.
APPLIED = ("exists", "incrby", "expire", "watch")
PRODUCER = ("xadd", "xinfo|groups", "xlen")  # adds under the backlog bound, which it reads
RETENTION = ("xinfo|groups", "xlen", "xpending", "xtrim")  # trims what every group has finished (XTRIM MINID)


@dataclass(frozen=True)
class KeyGrant:
    """Keys matching ``patterns`` (Redis globs), with ``access``, for ``commands`` alone: one ACL selector, so a
    command granted on one key is refused on every other (a generator may ``SET`` its registration, never the
    prompts stream). ``why`` says what the service does there."""

    patterns: tuple[str, ...]
    access: Access
    commands: tuple[str, ...]
    why: str

    @property
    def rule(self) -> str:
        """The Redis 7 selector: ``(%R~<pattern> +<command> ...)``."""
        keys = " ".join(f"{_ACCESS_PREFIX[self.access]}{p}" for p in self.patterns)
        return f"({keys} {' '.join(f'+{command}' for command in dict.fromkeys(self.commands))})"


def _grant(name: str, access: Access, commands: Sequence[str], why: str) -> KeyGrant:
    return KeyGrant((pattern(name),), access, tuple(commands), why)


@dataclass(frozen=True)
class Grant:
    """What one service's user may do: the keyless commands, and each key pattern's commands."""

    role: str
    keys: tuple[KeyGrant, ...]
    commands: tuple[str, ...] = KEYLESS

    def rules(self) -> list[str]:
        """The ACL rules after the user's name and password: nothing but these commands on these keys."""
        commands = [f"+{command}" for command in dict.fromkeys(self.commands)]
        return ["resetkeys", "resetchannels", "-@all", *commands, *(key.rule for key in self.keys)]


def pattern(name: str) -> str:
    """A key name as an ACL glob that matches it alone; ``_VARIABLE`` in it becomes ``*``."""
    return "*".join(_GLOB_SPECIAL.sub(r"\\\1", part) for part in name.split(_VARIABLE))


def _consumer(keys: Keys, stream: str, group: str, reader: str) -> tuple[KeyGrant, ...]:
    """A consumer group's stream and its applied markers (both read and written by a commit)."""
    return (
        _grant(stream, "RW", CONSUMER, f"reads {reader} as group `{group}` (EVAL: claims its lost entries)"),
        _grant(
            keys.applied(stream, group, _VARIABLE),
            "RW",
            APPLIED,
            "its applied markers, made under WATCH in a commit (INCRBY: a counter, never a value sent)",
        ),
    )


def _gpu_leases(keys: Keys) -> str:
    """Every GPU lease of every host: ``<prefix>:gpu:*:*`` (the index is an int, so it is cut off and starred)."""
    name = keys.gpu_lease(_VARIABLE, 0)
    return name[: -len("0")] + _VARIABLE


def _generator(keys: Keys) -> Grant:
    return Grant(
        "generator",
        (
            *_consumer(keys, keys.prompts, Keys.GENERATORS, "prompts"),
            _grant(keys.rollouts, "RW", PRODUCER, "writes rollouts under the backlog bound"),
            _grant(keys.dead_letter, "W", ("xadd",), "dead letters"),
            _grant(keys.registrations, "W", ("rpush",), "files its registration key, reading no other (RPUSH)"),
            _grant(
                keys.registration(_VARIABLE),
                "W",
                ("set", "del"),
                "its registration (SET PX), under the name only it knows",
            ),
            _grant(keys.weights, "R", ("get",), "the announced policy version"),
            _grant(keys.checkpoint, "R", ("get",), "the checkpoint to start from"),
            _grant(
                _gpu_leases(keys),
                "RW",
                ("set", "get", "mget", "del", "eval"),
                "GPU leases (SET NX; EVAL renews and releases its own)",
            ),
        ),
    )


def _scorer(keys: Keys) -> Grant:
    return Grant(
        "scorer",
        (
            *_consumer(keys, keys.rollouts, Keys.SCORERS, "rollouts"),
            _grant(keys.scored, "RW", PRODUCER, "writes scored groups under the backlog bound"),
            _grant(keys.evaluated, "W", ("xadd",), "writes scored held-out groups"),
            _grant(keys.dead_letter, "W", ("xadd",), "dead letters"),
        ),
    )


def _learner(keys: Keys) -> Grant:
    state = ("hset", "hget", "hexists", "hdel")  # HDEL: the set-aside script removes the field it set aside
    return Grant(
        "learner",
        (
            *_consumer(keys, keys.scored, Keys.LEARNER, "scored groups"),
            *_consumer(keys, keys.evaluated, Keys.LEARNER, "scored held-out groups"),
            _grant(
                keys.prompts,
                "RW",
                ("xadd", *RETENTION),
                "admits prompts, measures the backlog, trims what every group finished",
            ),
            *(
                _grant(stream, "RW", RETENTION, "measures the backlog, trims what every group finished (MINID)")
                for stream in (keys.rollouts, keys.scored, keys.evaluated)
            ),
            _grant(keys.dead_letter, "W", ("xadd",), "dead letters"),
            _grant(keys.learner_state, "RW", state, "its state: feeder position, runtime"),
            _grant(keys.registrations, "RW", ("lrange", "lrem"), "lists registrations, drops dead or invalid ones"),
            _grant(keys.registration(_VARIABLE), "R", ("strlen", "getrange"), "reads each, up to the size limit"),
            _grant(keys.weights, "W", ("set",), "announces each policy version"),
            _grant(keys.checkpoint, "W", ("set",), "announces each checkpoint"),
            # EVAL is checked against one selector holding every key it names; the script's own commands are
            # checked one by one against the grants above (HGET, HDEL, XADD), so nothing else runs inside.
            KeyGrant(
                tuple(pattern(name) for name in (keys.learner_state, keys.dead_letter)),
                "RW",
                ("eval",),
                "sets an invalid value aside in the dead letters (EVAL: HGET, HDEL, XADD)",
            ),
        ),
    )


def grants(keys: Keys) -> dict[str, Grant]:
    """Every service's grant for the pipeline of ``keys``, by role."""
    return {grant.role: grant for grant in (_generator(keys), _scorer(keys), _learner(keys))}


def config_quoted(value: str) -> str:
    """``value`` as one token of a redis.conf line (double quotes, its ``\\`` and ``"`` escaped)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_lines(passwords: Mapping[str, str], keys: Keys) -> list[str]:
    """``redis.conf`` lines that create every service's user with its password, one ``user`` line each. They
    reach ``redis-server`` on its standard input (``redis-server -``), never as arguments: a command line is
    readable by every local user (``/proc/<pid>/cmdline``)."""
    return [
        " ".join(["user", role, "on", config_quoted(f">{passwords[role]}"), *grant.rules()])
        for role, grant in grants(keys).items()
    ]


def service_url(url: str, role: str, password: str) -> str:
    """``url`` (the administrator's, or none's) logging in as ``role`` with ``password`` instead."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(role, safe='')}:{quote(password, safe='')}@{host}"))


# The deployments' redis container: the shell fills in the passwords from the container's environment inside a
# here-document, which reaches redis-server on its standard input; no password is on any command line.
_DEPLOY_COMMAND = "exec redis-server - --appendonly yes --appendfsync everysec <<EOF"
_DEPLOY_INDENT = {"compose": 8, "k8s": 14}  # docker-compose.yml's and redis.yaml's block of the script


def _wrapped(line: str, width: int) -> list[str]:
    """``line`` cut at spaces into lines of at most ``width`` characters, each but the last ending in `` \\``:
    the here-document joins them back into ``line`` exactly (a backslash-newline is removed)."""
    out, current = [], ""
    for token in line.split(" "):
        candidate = f"{current} {token}" if current else token
        if current and len(candidate) + 2 > width:
            out.append(f"{current} \\")
            current = token
        else:
            current = candidate
    return [*out, current]


def deploy_script(kind: str) -> str:
    """The shell script the redis container of ``docker-compose.yml`` (``compose``: ``$$`` for compose to pass
    ``$`` on, the prefix from ``.env``) or ``deploy/k8s/redis.yaml`` (``k8s``) runs: redis-server with the
    administrator's password and every service's user in its configuration, on standard input."""
    if kind not in _DEPLOY_INDENT:
        raise ValueError(f"no deployment kind {kind!r}: compose or k8s")
    dollar = "$$" if kind == "compose" else "$"
    keys = Keys("${STREAM_PREFIX:-grpo}") if kind == "compose" else Keys()
    passwords = {role: f"{dollar}{{{secret_name(role)}}}" for role in ROLES}
    lines = [f"requirepass {config_quoted(dollar + '{REDIS_PASSWORD}')}", *config_lines(passwords, keys)]
    width = 120 - _DEPLOY_INDENT[kind]
    return "\n".join([_DEPLOY_COMMAND, *(part for line in lines for part in _wrapped(line, width)), "EOF"]) + "\n"


def secret_name(role: str) -> str:
    """The variable (``.env``, the Kubernetes Secret) holding ``role``'s Redis password."""
    return f"REDIS_{role.upper()}_PASSWORD"


def _shown(command: str) -> str:
    """A command as the docs write it: ``client|setinfo`` -> ```CLIENT SETINFO``` (a bare | splits a table)."""
    return f"`{command.replace('|', ' ').upper()}`"


def markdown_table(keys: Keys) -> str:
    """Who may do what, for the docs: one row per service and key pattern, with the only commands it may run
    there; then the commands every user may run on no key."""
    rows = ["| User | Key pattern | Access | Commands | What for |", "|---|---|---|---|---|"]
    for role, grant in grants(keys).items():
        for key in grant.keys:
            patterns = " ".join(f"`{p}`" for p in key.patterns)
            commands = ", ".join(_shown(c) for c in dict.fromkeys(key.commands))
            rows.append(f"| `{role}` | {patterns} | {key.access} | {commands} | {key.why} |")
    shown = ", ".join(_shown(c) for c in KEYLESS)
    rows += ["", f"Every user may also run {shown} (no key), and nothing else: no command on a key it is not granted."]
    return "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    """``python -m shared.redis_acl compose|k8s|table``: what to paste into the deployment files or docs."""
    kind = argv[0] if argv else ""
    if kind in _DEPLOY_INDENT:
        indent = " " * _DEPLOY_INDENT[kind]
        print("\n".join(indent + line for line in deploy_script(kind).splitlines()))
    elif kind == "table":
        print(markdown_table(Keys()))
    else:
        print("usage: python -m shared.redis_acl compose|k8s|table", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
