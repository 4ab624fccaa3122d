"""Least privilege in Redis: one ACL user per service, allowed only the commands and keys it uses.

Anyone who can write to Redis can steer a run: register a generator URL the learner then sends its API token
to, or put groups of their own in the scored stream. So each service logs in as its own user (``generator``,
``scorer``, ``learner``), and Redis refuses it every command and key it does not need: a scorer cannot
register a generator, a generator cannot write scored groups, none of them can run ``FLUSHALL``, ``CONFIG``
or ``KEYS``. The default user stays the administrator (``REDIS_PASSWORD``: operators, health checks).

This module is the one definition. ``docker-compose.yml`` and ``deploy/k8s/redis.yaml`` carry its rules as
``redis-server --user ...`` arguments (``python -m shared.redis_acl compose|k8s`` prints them; a test checks
that the committed files say the same), ``asyncgrpo run`` starts its own Redis with them, and
``python -m shared.redis_acl table`` prints the documentation table.

Key patterns are the names of :class:`shared.keys.Keys` with the variable part as ``*``; access is per
pattern: ``RW`` (``~``), read only (``%R~``) or write only (``%W~``), as Redis checks it from each command's
key specification (``XADD`` and ``HSET`` only write, ``XINFO`` and ``GET`` only read, ``XREADGROUP`` does both).
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

# Commands by what they serve. Not CLIENT SETINFO, which redis-py sends on connecting and does without (and
# Redis 7.0 does not know: a rule naming it would stop the server).
CONNECTION = ("ping", "select")  # select: the database number of REDIS_URL
TRANSACTION = ("multi", "exec", "discard", "watch", "unwatch")  # commits are MULTI/EXEC under WATCH
CONSUMER = ("xgroup|create", "xreadgroup", "xautoclaim", "xclaim", "xpending", "xack", "exists", "set", "xadd", "eval")
PRODUCER = ("xadd", "xinfo|groups", "xlen", "xtrim", "xpending")  # the backlog bound reads and trims
BACKLOG = ("xinfo|groups", "xlen")  # what a group has not finished


@dataclass(frozen=True)
class KeyGrant:
    """Keys matching ``pattern`` (a Redis glob), with ``access``; ``why`` says what the service does there."""

    pattern: str
    access: Access
    why: str

    @property
    def rule(self) -> str:
        return f"{_ACCESS_PREFIX[self.access]}{self.pattern}"


@dataclass(frozen=True)
class Grant:
    """What one service's user may do."""

    role: str
    commands: tuple[str, ...]
    keys: tuple[KeyGrant, ...]

    def rules(self) -> list[str]:
        """The ACL rules after the user's name and password: nothing but these commands and keys."""
        commands = [f"+{command}" for command in dict.fromkeys(self.commands)]
        return ["resetkeys", "resetchannels", "-@all", *commands, *(key.rule for key in self.keys)]


def pattern(name: str) -> str:
    """A key name as an ACL glob that matches it alone; ``_VARIABLE`` in it becomes ``*``."""
    return "*".join(_GLOB_SPECIAL.sub(r"\\\1", part) for part in name.split(_VARIABLE))


def _consumer(keys: Keys, stream: str, group: str, reader: str) -> tuple[KeyGrant, ...]:
    """A consumer group's stream and its applied markers (both read and written by a commit)."""
    return (
        KeyGrant(pattern(stream), "RW", f"reads {reader} as group `{group}`: XREADGROUP, XAUTOCLAIM, XACK, EVAL"),
        KeyGrant(pattern(keys.applied(stream, group, _VARIABLE)), "RW", "applied markers: EXISTS, SET under WATCH"),
    )


def _gpu_leases(keys: Keys) -> str:
    """Every GPU lease of every host: ``<prefix>:gpu:*:*`` (the index is an int, so it is cut off and starred)."""
    name = keys.gpu_lease(_VARIABLE, 0)
    return pattern(name[: -len("0")] + _VARIABLE)


def _generator(keys: Keys) -> Grant:
    return Grant(
        "generator",
        (*CONNECTION, *TRANSACTION, *CONSUMER, *PRODUCER, "get", "mget", "del", "hset", "hdel", "eval"),
        (
            *_consumer(keys, keys.prompts, Keys.GENERATORS, "prompts"),
            KeyGrant(pattern(keys.rollouts), "RW", "writes rollouts under the backlog bound (XADD, XINFO, XTRIM)"),
            KeyGrant(pattern(keys.dead_letter), "W", "dead letters (XADD)"),
            KeyGrant(pattern(keys.generators), "W", "its registration (HSET, HDEL)"),
            KeyGrant(pattern(keys.generator_alive(_VARIABLE)), "W", "its heartbeat (SET PX, DEL)"),
            KeyGrant(pattern(keys.weights), "R", "the announced policy version (GET)"),
            KeyGrant(pattern(keys.checkpoint), "R", "the checkpoint to start from (GET)"),
            KeyGrant(_gpu_leases(keys), "RW", "GPU leases (SET NX, MGET, EVAL)"),
        ),
    )


def _scorer(keys: Keys) -> Grant:
    return Grant(
        "scorer",
        (*CONNECTION, *TRANSACTION, *CONSUMER, *PRODUCER),
        (
            *_consumer(keys, keys.rollouts, Keys.SCORERS, "rollouts"),
            KeyGrant(pattern(keys.scored), "RW", "writes scored groups under the backlog bound"),
            KeyGrant(pattern(keys.evaluated), "W", "writes scored held-out groups (XADD)"),
            KeyGrant(pattern(keys.dead_letter), "W", "dead letters (XADD)"),
        ),
    )


def _learner(keys: Keys) -> Grant:
    return Grant(
        "learner",
        (*CONNECTION, *TRANSACTION, *CONSUMER, *BACKLOG, "hset", "hget", "hexists", "hgetall", "hdel", "eval"),
        (
            *_consumer(keys, keys.scored, Keys.LEARNER, "scored groups"),
            *_consumer(keys, keys.evaluated, Keys.LEARNER, "scored held-out groups"),
            KeyGrant(pattern(keys.prompts), "RW", "admits prompts (XADD) and measures the backlog (XINFO, XLEN)"),
            KeyGrant(pattern(keys.rollouts), "R", "measures the backlog (XINFO, XLEN)"),
            # RW: EVAL needs both on every key it names, and setting an invalid registration aside names it.
            KeyGrant(pattern(keys.dead_letter), "RW", "dead letters (XADD; EVAL when it sets a registration aside)"),
            KeyGrant(pattern(keys.learner_state), "RW", "its state: feeder position, runtime (HSET, HGET, HEXISTS)"),
            KeyGrant(pattern(keys.generators), "RW", "lists registrations, drops dead or invalid ones (HGETALL, HDEL)"),
            KeyGrant(pattern(keys.generator_alive(_VARIABLE)), "R", "generators' heartbeats (EXISTS)"),
            KeyGrant(pattern(keys.weights), "W", "announces each policy version (SET)"),
            KeyGrant(pattern(keys.checkpoint), "W", "announces each checkpoint (SET)"),
        ),
    )


def grants(keys: Keys) -> dict[str, Grant]:
    """Every service's grant for the pipeline of ``keys``, by role."""
    return {grant.role: grant for grant in (_generator(keys), _scorer(keys), _learner(keys))}


def server_arguments(passwords: Mapping[str, str], keys: Keys) -> list[str]:
    """``redis-server`` arguments that create every service's user with its password (one token each)."""
    arguments: list[str] = []
    for role, grant in grants(keys).items():
        arguments += ["--user", role, "on", f">{passwords[role]}", *grant.rules()]
    return arguments


def service_url(url: str, role: str, password: str) -> str:
    """``url`` (the administrator's, or none's) logging in as ``role`` with ``password`` instead."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(role, safe='')}:{quote(password, safe='')}@{host}"))


def _yaml_lines(tokens: Sequence[str], indent: str) -> list[str]:
    """``tokens`` as double-quoted YAML flow items, one ``--user`` per line run, lines under 120 columns."""
    lines: list[str] = []
    line = ""
    for token in tokens:
        item = '"' + token.replace("\\", "\\\\").replace('"', '\\"') + '",'
        if line and (token == "--user" or len(indent) + len(line) + 1 + len(item) > 118):
            lines.append(indent + line)
            line = ""
        line = f"{line} {item}" if line else item
    return [*lines, indent + line] if line else lines


_DEPLOY_INDENT = {"compose": 6, "k8s": 12}  # docker-compose.yml's redis command, redis.yaml's args


def deploy_arguments(kind: str) -> list[str]:
    """The ACL arguments as ``docker-compose.yml`` (``compose``: ``${...}`` from ``.env``) or
    ``deploy/k8s/redis.yaml`` (``k8s``: ``$(...)`` from the pod's environment) write them."""
    if kind == "compose":
        passwords = {r: f"${{{secret_name(r)}:?set {secret_name(r)} in .env}}" for r in ROLES}
        return server_arguments(passwords, Keys("${STREAM_PREFIX:-grpo}"))
    if kind == "k8s":
        return server_arguments({r: f"$({secret_name(r)})" for r in ROLES}, Keys())
    raise ValueError(f"no deployment kind {kind!r}: compose or k8s")


def secret_name(role: str) -> str:
    """The variable (``.env``, the Kubernetes Secret) holding ``role``'s Redis password."""
    return f"REDIS_{role.upper()}_PASSWORD"


def _shown(command: str) -> str:
    """A command as the docs write it: ``client|setinfo`` -> ```CLIENT SETINFO``` (a bare | splits a table)."""
    return f"`{command.replace('|', ' ').upper()}`"


def markdown_table(keys: Keys) -> str:
    """Who may do what, for the README: one row per service and key pattern."""
    rows = ["| User | Key pattern | Access | What for |", "|---|---|---|---|"]
    for role, grant in grants(keys).items():
        for key in grant.keys:
            rows.append(f"| `{role}` | `{key.pattern}` | {key.access} | {key.why} |")
    rows += ["", "| User | Commands |", "|---|---|"]
    for role, grant in grants(keys).items():
        rows.append(f"| `{role}` | {', '.join(_shown(c) for c in dict.fromkeys(grant.commands))} |")
    return "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    """``python -m shared.redis_acl compose|k8s|table``: what to paste into the deployment files or docs."""
    kind = argv[0] if argv else ""
    if kind in _DEPLOY_INDENT:
        print("\n".join(_yaml_lines(deploy_arguments(kind), " " * _DEPLOY_INDENT[kind])))
    elif kind == "table":
        print(markdown_table(Keys()))
    else:
        print("usage: python -m shared.redis_acl compose|k8s|table", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
