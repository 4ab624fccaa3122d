"""Which LoRA adapters a generator keeps loaded in vLLM, by policy version: the bookkeeping of adapter sync.

Adapter sync (not wired into the engine yet): with ``learner.lora`` on, a push is to carry the adapter
alone; vLLM serves it by name and integer id (``LoRARequest``), loaded with ``add_lora`` and dropped with
``remove_lora``. A request carries the ``LoRARequest`` it was submitted with, so it samples every token with
that adapter even when newer ones are loaded meanwhile; it needs its adapter loaded until it finishes. A
request older than ``max_staleness`` versions is not trained on, so ``max_staleness + 1`` adapters (the one
served and the ``max_staleness`` before
it) are kept and older ones removed.

vLLM wants an id unique to an adapter's weights: a learner restarted from a checkpoint pushes a version it
pushed before with other weights, so ids are never reused, not derived from the version. This module holds no
engine: :class:`AdapterSlots` says what to load and what to remove; the engine does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ADAPTER_PREFIX = "policy-v"  # an adapter's name in vLLM: the policy version it is


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter loaded in vLLM: the policy version it is, its vLLM id (>= 1, never reused) and name."""

    version: int
    lora_id: int

    @property
    def name(self) -> str:
        return adapter_name(self.version, self.lora_id)


def adapter_name(version: int, lora_id: int) -> str:
    """vLLM's name of an adapter: its version, and its id (a version pushed again after a reset is another)."""
    return f"{ADAPTER_PREFIX}{version}-{lora_id}"


def kept_adapters(max_staleness: int) -> int:
    """Adapters kept loaded: the one served and the ``max_staleness`` before it (older requests are not trained)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness = {max_staleness}: it must be 0 or more")
    return max_staleness + 1


@dataclass
class AdapterSlots:
    """The adapters loaded, oldest first, at most ``keep`` of them; the newest is the one served."""

    keep: int
    loaded: list[LoadedAdapter] = field(default_factory=list)
    next_id: int = 1  # vLLM refuses id 0

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep = {self.keep}: at least the served adapter stays loaded")

    @property
    def served(self) -> LoadedAdapter | None:
        """The adapter new requests sample with (None before the first adapter push)."""
        return self.loaded[-1] if self.loaded else None

    def plan(self, version: int) -> tuple[LoadedAdapter, list[LoadedAdapter]]:
        """For a pushed adapter of ``version``: the adapter to load (a fresh id) and those to remove once it is
        loaded (the oldest beyond ``keep``). Nothing changes until :meth:`loaded_ok`: a failed load leaves every
        adapter as it was, the last one still served."""
        adapter = LoadedAdapter(version, self.next_id)
        self.next_id += 1  # also after a failed load: vLLM may hold a half-loaded adapter of that id
        return adapter, [*self.loaded, adapter][: -self.keep]

    def loaded_ok(self, adapter: LoadedAdapter) -> None:
        """``adapter`` is loaded: it is served from now on, and the oldest beyond ``keep`` are forgotten."""
        self.loaded = [*self.loaded, adapter][-self.keep :]
