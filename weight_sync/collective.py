"""The gloo and NCCL transports, both halves: the learner's store, the push's process group (the learner is
rank 0, a generator's engine worker k takes ``first_rank + k``), the bucket broadcast, and the group's
teardown.

* ``gloo`` (CPU): a process group of its own for each push - never the global one, which vLLM's engine may
  use - over the learner's ``TCPStore`` + a ``PrefixStore`` (one namespace per push).
* ``nccl`` (GPUs other than the learner's): vLLM's ``StatelessProcessGroup`` + ``PyNcclCommunicator``,
  built on the same store and namespace (``StatelessProcessGroup.create`` would make rank 0 bind
  ``weight_sync_port`` a second time). vLLM is imported only here, inside the functions that need it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from datetime import timedelta
from typing import Any

import torch

from shared.allowed_hosts import LOOPBACK

log = logging.getLogger(__name__)

_LISTEN_BACKLOG = 512  # generators joining one push's group connect at once


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


def release_in_background(holder: list[Any], name: str) -> None:
    """Empty ``holder``, a list holding the only references to some objects, on a daemon thread, so their
    destructors run there (the caller drops its own references *before* calling: otherwise the last one,
    and the destructor, could still be the caller's). A gloo process group's destructor waits for its
    threads and sockets: 17-20 ms per group (measured with torch 2.13 on the 2-core CI machine), which the
    end of a weight push need not wait for; the waiting releases the GIL."""
    threading.Thread(target=holder.clear, name=name, daemon=True).start()
