"""Parameters that live in the learner's send buffers: after a push, each pushed tensor that travelled uncast
has a slot in the CPU buffers kept for the next push (:func:`slot_views`); a parameter moved there
(:func:`place_parameters`) is packed by the next push with no copy at all (``pack_bucket`` sees it lies in
its slot). After a push that failed, :func:`own_parameters` gives them private memory again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from shared.records import DType
from weight_sync.protocol import DTYPES, bucket_views, lies_in, pack_entries


def slot_views(
    named: Sequence[tuple[str, torch.Tensor]],
    buckets: Sequence[Sequence[int]],
    dtype: DType | None,
    buffers: Sequence[torch.Tensor],
    transposed: Collection[str] = (),
    joined: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Where :func:`pack_bucket` puts each of ``named`` in ``buffers`` (one per bucket), as a tensor of its
    dtype and shape (with the strides of a transposed slot for the names in ``transposed``, of a run of a
    block's columns for those in ``joined`` and the ones they join); only the tensors that travel in their own
    dtype (a cast copy is not the tensor)."""
    target = DTYPES[dtype] if dtype is not None else None
    views: dict[str, torch.Tensor] = {}
    for indices, buffer in zip(buckets, buffers, strict=True):
        tensors = [named[i][1] for i in indices]
        flags = [named[i][0] in transposed for i in indices]
        joins = [named[i][0] in joined for i in indices]
        slots = bucket_views(buffer, pack_entries(tensors, target, flags, joins), whole=False)
        for index, slot in zip(indices, slots, strict=True):
            name, tensor = named[index]
            if slot.dtype == tensor.dtype:
                views[name] = slot
    return views


def place_parameters(
    model: torch.nn.Module, homes: dict[str, torch.Tensor], *, contiguous_only: bool = False
) -> list[torch.nn.Parameter]:
    """Move each parameter of ``model`` named in ``homes`` into that memory (its values copied there first)
    and return the parameters that live there now. The next push then packs them by no copy at all. Their
    values must not change while a push reads them: the learner pushes between optimizer steps.
    ``contiguous_only``: leave out homes that are transposed or sliced views (a fused optimizer's kernel
    needs contiguous parameters)."""
    placed = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            home = homes.get(name)
            if home is None or home.dtype != param.dtype or home.shape != param.shape or home.device != param.device:
                continue  # (a home stored transposed has the parameter's shape, and strides of its own)
            if contiguous_only and not home.is_contiguous():
                continue
            if not lies_in(param, home):
                home.copy_(param)
                param.data = home
            placed.append(param)
    return placed


def own_parameters(params: Sequence[torch.nn.Parameter]) -> None:
    """Give ``params`` private memory again (after a push that failed, a receiver or a sending thread may
    still read the buffers they lie in, which the next optimizer step would change under it)."""
    with torch.no_grad():
        for param in params:
            param.data = param.data.clone()
