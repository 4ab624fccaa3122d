"""The gloo and NCCL transports, both halves: the learner's store, the push's process group (the learner is
rank 0, a generator's engine worker k takes ``first_rank + k``), the bucket broadcast, and the group's
teardown.

* ``gloo`` (CPU): a process group of its own - never the global one, which vLLM's engine may use - formed
  over the learner's ``TCPStore`` + a ``PrefixStore`` (one namespace per push) and kept from push to push
  while its members stay the same (:class:`KeptGroup`; forming one costs a round of store traffic and
  connections, tearing one down 17-20 ms). Each push starts with a handshake in its namespace: the learner
  offers the group it kept (or none), every other rank says whether it holds that very group, and the learner
  decides to reuse it (all hold it) or to form a new one (a generator restarted, its last push was cut
  short); so a member that joined, left or restarted costs a new group, never a hang.
* ``nccl`` (GPUs other than the learner's): vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``,
  built on the same store and namespace (``StatelessProcessGroup.create`` would make rank 0 bind
  ``weight_sync_port`` a second time). vLLM is imported only here, inside the functions that need it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Hashable
from datetime import timedelta
from typing import Any

import torch

from shared.allowed_hosts import LOOPBACK

log = logging.getLogger(__name__)

_LISTEN_BACKLOG = 512  # generators joining one push's group connect at once
# A kept group idle longer than this is formed anew: stateful firewalls and NATs between hosts drop idle TCP
# flows (AWS's load balancers after 350 s), and a broadcast into a dropped flow would hang until the timeout.
MAX_IDLE_S = 120.0

# The reuse handshake, in the push's namespace (see the module docstring).
GROUP_OFFER_KEY = "group/offer"  # learner -> ranks: the token of the group it offers, "" for a new group
GROUP_DECISION_KEY = "group/decision"  # learner -> ranks: REUSE when every rank holds the offered group, else FORM
HELD, MISSING = b"held", b"missing"  # rank -> learner, under held_key(rank)
REUSE, FORM = b"reuse", b"form"


def listening_store(bind_host: str, port: int, timeout: timedelta) -> torch.distributed.TCPStore:
    """The learner's ``TCPStore``, listening on ``bind_host``'s address alone (port 0: a free one).

    A master ``TCPStore`` ignores its host argument and listens on every interface, so the socket is bound
    here and handed to it (``master_listen_fd``; the store owns it from then on)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        bind_host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(_LISTEN_BACKLOG)
    except OSError as exc:
        listener.close()
        raise OSError(
            exc.errno,
            f"the weight store cannot listen on {bind_host}:{port} ({exc.strerror}): set learner.weight_sync_bind "
            "to an address of this machine (the interface generators reach; '0.0.0.0' for every one)",
        ) from exc
    bound_host, bound_port = listener.getsockname()[:2]
    if ipaddress.ip_address(bound_host).is_loopback and bind_host not in LOOPBACK:
        log.warning(
            "the weight store listens on %s only (%s resolves there): generators on other machines cannot reach "
            "it; set learner.weight_sync_bind to the address they reach",
            bound_host,
            bind_host,
        )
    local = "::1" if bound_host == "::" else "127.0.0.1" if bound_host == "0.0.0.0" else bound_host
    return torch.distributed.TCPStore(
        local, bound_port, is_master=True, wait_for_workers=False, timeout=timeout,
        master_listen_fd=listener.detach(), use_libuv=True,
    )  # fmt: skip


def join_store(host: str, port: int, namespace: str, timeout: timedelta) -> torch.distributed.PrefixStore:
    """A generator's view of the learner's store, under the push's ``namespace``."""
    store = torch.distributed.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return torch.distributed.PrefixStore(namespace, store)


def form_group(store: Any, rank: int, world_size: int, device: torch.device, timeout: timedelta) -> Any:
    """This process's member of the push's group on ``store`` (the push's namespace): NCCL on CUDA, else
    gloo. Blocks until every member has joined (or the store's timeout)."""
    if device.type == "cuda":
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        return PyNcclCommunicator(StatelessProcessGroup(rank=rank, world_size=world_size, store=store), device)
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)


def start_broadcast(group: Any, buffer: torch.Tensor) -> Any:
    """Broadcast ``buffer`` from rank 0 (send on the learner, receive on a generator): NCCL at once (returns
    None), gloo in the background (returns the work to ``wait()`` on)."""
    if buffer.device.type == "cuda":
        group.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()
        return None
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


class PendingBucket:
    """A bucket being received: ``result()`` waits for it."""

    def __init__(self, buffer: torch.Tensor, work: Any) -> None:
        self.buffer, self.work = buffer, work

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buffer


def receive_bucket(group: Any, nbytes: int, device: torch.device, buffer: torch.Tensor | None) -> PendingBucket:
    """Start receiving one bucket of ``nbytes`` into ``buffer`` (a new one when None)."""
    if buffer is None:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return PendingBucket(buffer, start_broadcast(group, buffer))


def posting_schedule(num_buckets: int, ahead: int) -> tuple[list[int], list[list[int]]]:
    """The buckets a receiver starts receiving before it waits for the first, and, for each bucket k, those it
    starts once k has arrived (before loading k): while it loads bucket k, buckets k+1 .. k+``ahead`` are
    being received. gloo's sender waits until the receiver has started receiving a bucket before it sends it,
    so a receiver that starts every bucket at once (``ahead`` >= ``num_buckets``) never holds the sender up
    while it loads; one that starts one at a time needs a new buffer at a time only."""
    if ahead < 1:
        raise ValueError(f"a receiver receives at least the next bucket while it loads one, not {ahead}")
    first = list(range(min(ahead, num_buckets)))
    after = [[k + ahead] if k + ahead < num_buckets else [] for k in range(num_buckets)]
    return first, after


def release_in_background(holder: list[Any], name: str) -> None:
    """Empty ``holder``, a list holding the only references to some objects, on a daemon thread, so their
    destructors run there (the caller drops its own references *before* calling: otherwise the last one,
    and the destructor, could still be the caller's). A gloo process group's destructor waits for its
    threads and sockets: 17-20 ms per group (measured with torch 2.13 on the 2-core CI machine), which the
    end of a weight push need not wait for; the waiting releases the GIL."""
    threading.Thread(target=holder.clear, name=name, daemon=True).start()


def held_key(rank: int) -> str:
    """Where ``rank`` answers the learner's offer (HELD or MISSING)."""
    return f"group/held/{rank}"


class KeptGroup:
    """A gloo group kept from push to push. ``token``: the namespace of the push that formed it (unique per
    formation); ``members``: what must not change for it to serve a push (on the learner the ranks of the
    plan and the group's size, on a generator the learner's store, its rank and the size); ``used_at``: when a
    push last used it (monotonic). It holds the only reference to the group, so :meth:`retire` can tear it
    down in the background."""

    def __init__(self, group: Any, token: str, members: Hashable) -> None:
        self._holder = [group]
        self.token, self.members, self.used_at = token, members, time.monotonic()

    @property
    def group(self) -> Any:
        return self._holder[0]

    def retire(self) -> None:
        release_in_background(self._holder, "weight-group-release")


def may_offer(kept: KeptGroup | None, members: Hashable, now: float) -> bool:
    """Whether the learner offers ``kept`` to a push whose group has ``members``: the same members, and not
    idle longer than ``MAX_IDLE_S``."""
    return kept is not None and kept.members == members and now - kept.used_at <= MAX_IDLE_S


def answer_offer(kept: KeptGroup | None, offer: str, members: Hashable) -> bytes:
    """A rank's answer to the learner's offer: HELD when it holds the offered group, as the same member."""
    return HELD if kept is not None and kept.token == offer and kept.members == members else MISSING


def learner_group(
    store: Any, namespace: str, kept: KeptGroup | None, members: Hashable, world_size: int, timeout: timedelta
) -> KeptGroup:
    """Rank 0's gloo group for the push in ``namespace`` (``store`` is its view of it): ``kept`` when every
    other rank still holds it, else a new one (``kept`` is then torn down). The store's timeout bounds the
    wait for the ranks' answers, as it bounds forming a group."""
    store.set(GROUP_OFFER_KEY, kept.token if kept is not None else "")
    if kept is not None:
        keys = [held_key(rank) for rank in range(1, world_size)]
        try:
            store.wait(keys)
            reuse = all(store.get(key) == HELD for key in keys)
            store.set(GROUP_DECISION_KEY, REUSE if reuse else FORM)
        except BaseException:
            kept.retire()
            raise
        if reuse:
            kept.used_at = time.monotonic()
            return kept
        kept.retire()
    return KeptGroup(form_group(store, 0, world_size, torch.device("cpu"), timeout), namespace, members)


def member_group(
    store: Any, namespace: str, kept: KeptGroup | None, members: Hashable, rank: int, world_size: int,
    timeout: timedelta,
) -> KeptGroup:  # fmt: skip
    """A generator's gloo group for the push in ``namespace``: ``kept`` when the learner offers it and every
    rank holds it, else a new one (``kept`` is then torn down). ``members``: this rank's, as
    :func:`answer_offer` compares them."""
    try:
        offer = store.get(GROUP_OFFER_KEY).decode()
        if offer:
            store.set(held_key(rank), answer_offer(kept, offer, members))
        decision = store.get(GROUP_DECISION_KEY) if offer else FORM
    except BaseException:
        if kept is not None:
            kept.retire()
        raise
    if decision == REUSE:
        if kept is None:
            raise RuntimeError("the learner reuses a weight group this rank said it does not hold")
        kept.used_at = time.monotonic()
        return kept
    if kept is not None:
        kept.retire()
    return KeptGroup(form_group(store, rank, world_size, torch.device("cpu"), timeout), namespace, members)


class GroupKeeper:
    """The learner's kept gloo group between pushes. A push :meth:`take` s it (when it may be offered) and
    :meth:`keep` s the group it used once its sending succeeded; :meth:`discard` (a push that failed after
    all, the pusher closing) tears it down, and a push still sending then cannot keep its own."""

    def __init__(self) -> None:
        self._kept: KeptGroup | None = None
        self._generation = 0
        self._lock = threading.Lock()

    def take(self, members: Hashable) -> tuple[KeptGroup | None, int]:
        """The kept group when it may be offered to a push with ``members`` (else None: it is torn down), and
        the generation that :meth:`keep` must be given."""
        with self._lock:
            kept, self._kept = self._kept, None
            generation = self._generation
        if kept is not None and not may_offer(kept, members, time.monotonic()):
            kept.retire()
            kept = None
        return kept, generation

    def keep(self, group: KeptGroup, generation: int) -> None:
        with self._lock:
            if generation == self._generation and self._kept is None:
                self._kept = group
                return
        group.retire()

    def discard(self) -> None:
        with self._lock:
            self._generation += 1
            kept, self._kept = self._kept, None
        if kept is not None:
            kept.retire()
