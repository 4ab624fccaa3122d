"""glibc malloc settings for a CPU generator's vLLM engine processes: keep what a step frees for the next step.

On CPUs the generator runs vLLM's multiprocess executor (:mod:`services.generator.executor`): each step's
scheduler output is deserialised in the worker process, which allocates that step's buffers. With glibc's
defaults a large block is an ``mmap`` given back at ``free``, so the next step faults it in again and the kernel
zeroes every page. Measured with ``bench/generator.py`` on a 2-core AVX2 AMD EPYC (per-process ``/proc``
counters every 2 s while sampling): the service's vLLM worker took 15,000-20,000 minor page faults a second (6-10 %
of its time in the kernel), vLLM alone in one process about 10; with these settings the worker took 10-50. vLLM
starts the engine processes itself (spawned), so the settings travel as ``GLIBC_TUNABLES`` in the environment,
which glibc reads when a process starts; they follow the environment's own, and the last setting of a tunable
wins. ``keep_freed_memory = false`` in ``[generator]`` leaves glibc's defaults.
"""

from __future__ import annotations

from collections.abc import MutableMapping

TUNABLES_ENV = "GLIBC_TUNABLES"
# No mmap for large blocks; the top of the heap is returned only past 2 GiB free (as the CPU learner's malloc).
KEEP_FREED = ("glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=2147483647")


def engine_tunables(existing: str) -> str:
    """``GLIBC_TUNABLES`` for the engine processes: the environment's ``existing`` value, then :data:`KEEP_FREED`
    (once: applying it again changes nothing)."""
    return ":".join([part for part in existing.split(":") if part and part not in KEEP_FREED] + list(KEEP_FREED))


def keep_freed_in_engines(environ: MutableMapping[str, str], keep_freed_memory: bool, on_cpu: bool) -> None:
    """Set ``environ``'s ``GLIBC_TUNABLES`` for the engine processes vLLM will start, on a CPU engine with
    ``keep_freed_memory`` on (a GPU engine's memory is the device's; its host malloc is left alone)."""
    if on_cpu and keep_freed_memory:
        environ[TUNABLES_ENV] = engine_tunables(environ.get(TUNABLES_ENV, ""))
