"""``--record``: append a bench's result to ``bench/results.jsonl``, the history docs/benchmarks.md is made from.

One JSON line per run: the bench, its configuration (the command line's options), the figures it printed, the
ratio against its goal, and where it ran (CPU model, cores, GPU), when (UTC) and on which commit (``+dirty`` when
a tracked file other than the results file had changes). ``python tools/docs_reference.py --write`` turns the
latest line of each (bench, configuration) into the page's table. A ``--quick`` run is a smoke test, not a
measurement: it is refused.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.jsonl"
RECORD_HELP = f"append the figures to {RESULTS.relative_to(ROOT)} (refused with --quick)"
# Options that change where or how often a bench reports, not what it measures: left out of the configuration.
_NOT_CONFIGURATION = frozenset({"record", "quick", "json", "show", "repeats", "child", "kind", "profile"})


class RecordError(ValueError):
    """A result that must not go into the history (a smoke test, a figure that is not a number)."""


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--record`` option every bench takes."""
    parser.add_argument("--record", action="store_true", help=RECORD_HELP)


def refuse_quick(args: argparse.Namespace) -> None:
    """Stop before a ``--quick --record`` run spends its time: the figures would be refused at the end."""
    if getattr(args, "record", False) and getattr(args, "quick", False):
        raise SystemExit("--record is refused with --quick: a smoke test's figures are not a measurement; drop --quick")


def configuration(args: argparse.Namespace) -> dict[str, Any]:
    """The options that define what was measured (sorted; Paths as text)."""
    options = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_CONFIGURATION}
    return json.loads(json.dumps(options, default=str))


# The widest vector unit a CPU has, first match: the same model name hides instances a CPU bench runs at
# different speeds (an AMD EPYC with AVX-512 BF16 computes in bf16, one with AVX2 alone in float32).
_VECTOR_UNITS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def vector_unit(cpuinfo: str) -> str | None:
    """ "AMX", "AVX-512 BF16", "AVX-512" or "AVX2" from /proc/cpuinfo's first flags line; None: none of them."""
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return next((name for flag, name in _VECTOR_UNITS if flag in flags), None)


def machine() -> dict[str, Any]:
    """CPU model and vector unit, cores this process may use, and the GPU's name when torch sees one."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return {
        "cpu": names[0] if names else platform.processor() or "unknown CPU",
        "vector": vector_unit(cpuinfo),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": _gpu_name(),
    }


def _gpu_name() -> str | None:
    torch = sys.modules.get("torch")  # only a bench that imported torch can have used a GPU
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def commit(root: Path = ROOT) -> str:
    """``git rev-parse --short HEAD``, with ``+dirty`` when the working tree has changes; "unknown" outside git.

    Rows added to the results file are not changes to what ran: without that exception a bench that records two
    rows (weight_push: one per generator count), or a second bench before the first's row is committed, would
    mark its rows dirty on account of the earlier ones."""

    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return result.stdout.strip() if result.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS.relative_to(ROOT)}")
    return head + ("+dirty" if changes else "")


def entry(
    bench: str, figures: Mapping[str, float], args: argparse.Namespace, ratio: float | None, goal: str
) -> dict[str, Any]:
    """The line :func:`record` appends; a RecordError for a smoke test or a figure that is not a finite number."""
    if getattr(args, "quick", False):
        raise RecordError(f"{bench}: --quick is a smoke test, its figures are not recorded; run it without --quick")
    checked = {**figures, "ratio": ratio} if ratio is not None else dict(figures)
    bad = {k: v for k, v in checked.items() if not _finite(v)}
    if bad:
        raise RecordError(f"{bench}: figures must be finite numbers, got {bad}; nothing was recorded")
    return {
        "bench": bench,
        "configuration": configuration(args),
        "figures": {k: float(v) for k, v in figures.items()},
        "ratio": float(ratio) if ratio is not None else None,
        "goal": goal,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]) if sys.argv else "",
    }


def _finite(value: object) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value)


def record(
    bench: str,
    figures: Mapping[str, float],
    args: argparse.Namespace,
    *,
    ratio: float | None,
    goal: str,
    path: Path = RESULTS,
) -> dict[str, Any]:
    """Append one result of ``bench`` (``figures``, its ``ratio`` and the ``goal`` it is read against, e.g.
    ">= 0.90"; a survey without a goal: ``ratio=None``, ``goal=""``) to ``path`` as a JSON line; returns the
    line's record."""
    line = entry(bench, figures, args, ratio, goal)
    with path.open("a", encoding="utf-8") as results:
        results.write(json.dumps(line, sort_keys=True) + "\n")
    print(f"recorded in {path}", file=sys.stderr)
    return line
