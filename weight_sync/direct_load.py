"""Loading pushed tensors into a vLLM model: the direct path (each pushed tensor copied into, or aliased as,
its rows of one engine parameter) and the layerwise fallback (vLLM's own reload helpers).

* direct: when every pushed tensor maps onto one engine parameter or one row block of a stacked one
  (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``), the engine is not sharded
  (tensor parallel 1) and nothing is quantized, each tensor is copied into its rows of the parameter
  in place (on the GPU, CUDA graphs keep their pointers). On vLLM-CPU the linear layers keep their weight
  only inside a oneDNN handle, so such a layer gets its stacked weight (a view of the bucket when the
  pieces lie back to back in it) and the layer's own ``process_weights_after_loading`` makes the handle.
  oneDNN reorders a weight stored transposed (``[in, out]`` contiguous) about twice as fast as one stored
  ``[out, in]``, so a CPU engine registers ``transposed_linear`` and the learner sends linear weights that
  way (``TensorSpec.transposed``); the pieces of a stacked layer are joined column-wise, in a scratch buffer
  kept from push to push (:class:`StackScratch`) when the layer makes its handle right after (else, e.g. a
  qkv weight whose biases arrive later, in new memory).
* in place (aliasing, ``generator.cpu_weights_in_place``; CPU, gloo, an eager engine): every parameter whose
  pushed tensor(s) lie back to back in a kept receive buffer becomes a view of it, so receiving the next push
  *is* loading it (:class:`DirectLoader`'s ``alias``).
* layerwise (:func:`layerwise_reload`): otherwise, vLLM's layerwise-reload helpers under
  ``set_current_vllm_config``, as vLLM's own weight-transfer engines do (calling ``model.load_weights`` bare
  fails on vLLM-CPU 0.32 with "'Parameter' object has no attribute 'weight_loader'").

vLLM is imported only inside the functions that need it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Quantization methods under which a parameter holds exactly the checkpoint's values (a direct copy is exact).
_PLAIN_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


# The plan ---------------------------------------------------------------------------------------------------


class DirectLoadUnavailable(ValueError):
    """The pushed tensors do not map one to one onto the engine's parameters (the reason says where)."""


@dataclass(frozen=True)
class TargetParam:
    """One engine parameter as the direct loader sees it: its full shape is
    ``(sum(piece_rows) + pad_rows, *trailing)``. A stacked parameter (``qkv_proj``) has one row block per
    source tensor, in ``sources`` order; a padded vocabulary has ``pad_rows`` zero rows after the pieces
    (vLLM's own loader zeroes them on every load)."""

    name: str
    sources: tuple[str, ...]
    piece_rows: tuple[int, ...]
    trailing: tuple[int, ...]
    pad_rows: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(self.piece_rows) + self.pad_rows, *self.trailing)


def source_names(param_name: str, packed_modules: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """Checkpoint names whose rows make up ``param_name``: ``a.qkv_proj.weight`` -> ``a.q_proj.weight``, ..."""
    module, _, leaf = param_name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last not in packed_modules:
        return (param_name,)
    prefix = f"{parent}." if parent else ""
    return tuple(f"{prefix}{piece}.{leaf}" for piece in packed_modules[last])


def plan_direct_load(
    pushed: Mapping[str, tuple[int, ...]], targets: Sequence[TargetParam]
) -> dict[str, tuple[str, int, int]]:
    """``source name -> (target name, first row, rows)`` when the push covers every target exactly.

    Raises DirectLoadUnavailable when a pushed tensor has no target, a target misses a piece, or shapes
    disagree (padded vocabularies, sharded or renamed parameters): the caller then loads layerwise.
    """
    plan: dict[str, tuple[str, int, int]] = {}
    for target in targets:
        row = 0
        for source, rows in zip(target.sources, target.piece_rows, strict=True):
            shape = pushed.get(source)
            if shape is None:
                raise DirectLoadUnavailable(f"{target.name} needs {source}, which the push does not carry")
            if tuple(shape) != (rows, *target.trailing):
                raise DirectLoadUnavailable(
                    f"{source} has shape {tuple(shape)}; {target.name} expects {(rows, *target.trailing)}"
                )
            plan[source] = (target.name, row, rows)
            row += rows
    extra = sorted(set(pushed) - set(plan))
    if extra:
        raise DirectLoadUnavailable(f"no engine parameter for {extra[0]} (and {len(extra) - 1} more)")
    return plan


class StackScratch:
    """Memory that transposed pieces are joined in (:func:`stack_rows`) right before a layer prepacks the
    join, kept from push to push: fresh memory would be faulted in every time, while this stays warm."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[rows, cols]`` tensor of ``like``'s dtype in the kept memory (grown when too small)."""
        nbytes = rows * cols * like.element_size()
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.device != like.device:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=like.device)
        return self.buffer[:nbytes].view(like.dtype).view(rows, cols)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.buffer is not None and tensor.untyped_storage().data_ptr() == self.buffer.data_ptr()


def stack_rows(pieces: Sequence[torch.Tensor], scratch: StackScratch | None = None) -> torch.Tensor:
    """The pieces concatenated along dim 0: a view when they lie back to back in one storage (as the
    learner packs ``q, k, v`` in one bucket), else a copy. Pieces that arrived transposed (2-D, strides
    ``(1, rows)``) are joined column-wise into one ``[in, rows]`` block (in ``scratch`` when given), returned
    transposed: the layout vLLM-CPU's oneDNN prepacking reads fastest (it packs from ``weight.t()``)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    joined = joined_view(pieces)
    if joined is not None:
        return joined
    if all(is_transposed(p) for p in pieces):
        columns = [p.t() for p in pieces]
        if scratch is None:
            return torch.cat(columns, dim=1).t()
        out = scratch.take(first.shape[1], sum(p.shape[0] for p in pieces), first)
        return torch.cat(columns, dim=1, out=out).t()
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype for p in pieces) and all(
        b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        for a, b in itertools.pairwise(pieces)
    )
    if not adjacent:
        return torch.cat(list(pieces))
    rows = sum(p.shape[0] for p in pieces)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def joined_view(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The pieces as one ``[sum of rows, in]`` view with strides ``(1, sum of rows)`` when they are consecutive
    column runs of one contiguous ``[in, sum of rows]`` block (transposed pieces the learner joined,
    ``TensorSpec.joined``), filling it; else None."""
    first = pieces[0]
    width = sum(p.shape[0] for p in pieces)
    if any(p.dim() != 2 or p.stride() != (1, width) or p.dtype != first.dtype for p in pieces):
        return None
    for a, b in itertools.pairwise(pieces):
        same_storage = b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        if not same_storage or b.shape[1] != a.shape[1] or b.data_ptr() != a.data_ptr() + a.shape[0] * a.element_size():
            return None
    return first.as_strided((width, first.shape[1]), (1, width), first.storage_offset())


def is_transposed(tensor: torch.Tensor) -> bool:
    """Whether a 2-D tensor is the transpose of a contiguous one (as transposed specs unpack), not itself
    contiguous."""
    return tensor.dim() == 2 and tensor.stride(0) == 1 and tensor.t().is_contiguous() and not tensor.is_contiguous()


def describe_targets(model: torch.nn.Module, tensor_parallel_size: int) -> list[TargetParam]:
    """Every parameter of a vLLM model as a :class:`TargetParam`; raises DirectLoadUnavailable where a
    direct copy would not give the same weights as vLLM's own loader (quantized or sharded layers)."""
    if tensor_parallel_size != 1:
        raise DirectLoadUnavailable("the engine is tensor-parallel: its parameters are shards")
    packed = getattr(type(model), "packed_modules_mapping", {}) or {}
    targets = []
    seen: set[int] = set()  # a tied parameter (lm_head = embed_tokens) is one target, under its first name
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _PLAIN_METHODS:
            raise DirectLoadUnavailable(f"{module_name} is quantized ({type(method).__name__})")
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{leaf}" if module_name else leaf
            sources = source_names(name, packed)
            if param.numel() == 0 and leaf == "weight":  # vLLM-CPU keeps this weight in a oneDNN handle
                rows = tuple(getattr(module, "output_partition_sizes", ()))
                cols = getattr(module, "input_size_per_partition", None)
                if not rows or cols is None:
                    raise DirectLoadUnavailable(f"{name} is empty and is not a linear layer's weight")
                trailing: tuple[int, ...] = (cols,)
            elif len(sources) > 1:
                rows, trailing = tuple(getattr(module, "output_partition_sizes", ())), tuple(param.shape[1:])
            else:
                rows, trailing = tuple(param.shape[:1]), tuple(param.shape[1:])
            pad = 0
            vocab = getattr(module, "org_vocab_size", None)  # a (padded) vocabulary embedding or LM head
            if vocab is not None and leaf == "weight" and rows and rows[0] > vocab:
                rows, pad = (vocab,), rows[0] - vocab
            if len(rows) != len(sources):
                raise DirectLoadUnavailable(f"{name}: {len(sources)} sources for {len(rows)} row blocks")
            targets.append(TargetParam(name, sources, rows, trailing, pad))
    return targets


def aliases(stacked: torch.Tensor, pieces: Sequence[torch.Tensor], target: TargetParam, dtype: torch.dtype) -> bool:
    """Whether ``stacked`` can become the parameter itself: a view of the received bucket (not a copy), with
    the parameter's dtype and no padding rows the parameter must hold beyond the pushed ones."""
    return (
        target.pad_rows == 0
        and stacked.dtype == dtype
        and stacked.untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr()
    )


def _contiguous_unless_prepacked(module: torch.nn.Module) -> None:
    """A transposed weight goes to vLLM-CPU's oneDNN prepacking as it is; the small-GEMM kernels vLLM picks
    on AMX CPUs for some bf16/fp16 weights (``check_cpu_sgl_kernel``) get it contiguous."""
    weight = getattr(module, "weight", None)
    if weight is None or not is_transposed(weight):
        return
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    if check_cpu_sgl_kernel(weight.shape[0], weight.shape[1], weight.dtype):
        weight.data = weight.data.contiguous()


class DirectLoader:
    """Puts pushed tensors into the engine's parameters as they arrive (see the module docstring).

    ``alias``: a parameter whose pushed tensor(s) lie back to back in a received bucket becomes a view of
    that bucket instead of getting a copy; when the worker receives the next push into the same buffers,
    such a parameter takes the new weights with no loading at all. A CPU layer whose parameters are all
    aliased computes with ``torch.nn.functional.linear`` on them (vLLM's own fallback), not a oneDNN handle
    holding a packed copy. Otherwise a CPU layer's handle is rebuilt as soon as all its parameters are in,
    while later buckets still arrive. ``aliased_bytes`` counts the bytes that needed no copy.

    ``borrowed``: the tensors lie in memory the sender writes the next push into (shared memory), so no
    parameter may keep pointing into it: after a layer sets up its kernel, a parameter still viewing that
    memory (vLLM's plain ``linear`` fallback keeps its weight) gets a copy, counted in
    ``copied_borrowed_bytes``. (A kernel that hides such a view where parameters cannot show it - vLLM's
    zentorch path - must be given private copies instead: the receiver does that.)

    ``scratch``: transposed pieces of a stacked parameter (``TensorSpec.transposed``) are joined there when
    its layer prepacks them right after (its last parameter is in), else in new memory; a parameter still
    viewing the scratch afterwards gets a copy too.

    ``defer``: a CPU layer with a 2-D weight does not get its handle during the push: its ``cpu_linear``
    becomes a :class:`PendingHandle` (listed in ``deferred``), which makes the handle on the layer's first call,
    in the engine's first step after the push, on the engine's own thread. Until then its weights must stay
    where they are: the receiver's kept buffers, which only the next push overwrites (which then sets every
    layer pending again), and for a stacked layer whose pieces did not travel joined its own join memory in
    ``joins`` (kept by the receiver from push to push, one :class:`StackScratch` per parameter: fresh memory
    would be faulted in every time), not the shared scratch."""

    def __init__(
        self,
        model: torch.nn.Module,
        plan: dict[str, tuple[str, int, int]],
        targets: list[TargetParam],
        alias: bool = False,
        borrowed: bool = False,
        scratch: StackScratch | None = None,
        defer: bool = False,
        joins: dict[str, StackScratch] | None = None,
    ):
        if alias and borrowed:
            raise ValueError("parameters cannot alias buffers the sender writes into (shared memory)")
        if defer and (alias or borrowed):
            raise ValueError("deferred handles need weights that stay put until they are made: not aliased or borrowed")
        self.defer = defer
        self.joins = joins if joins is not None else {}  # per parameter, when deferring
        self.deferred: list[torch.nn.Module] = []  # layers whose handle a PendingHandle makes on their first call
        self.plan = plan
        self.alias = alias
        self.borrowed = borrowed
        self.scratch = scratch  # where transposed pieces are joined for a layer about to prepack them
        self.targets = {t.name: t for t in targets}
        modules = dict(model.named_modules())
        self.params = {t.name: getattr(modules[t.name.rpartition(".")[0]], t.name.rpartition(".")[2]) for t in targets}
        # Modules computing through a CPU kernel handle, by the parameters they hold (a tied LM head too).
        handled: dict[int, list[Any]] = {}  # vLLM layers: ``cpu_linear``, ``quant_method``
        for module in modules.values():
            if hasattr(module, "cpu_linear"):
                for param in module.parameters(recurse=False):
                    handled.setdefault(id(param), []).append(module)
        self.handle_modules = {name: handled.get(id(param), []) for name, param in self.params.items()}
        self.module_left: dict[int, int] = {}  # targets still incomplete, per handle module
        self.module_aliased: dict[int, bool] = {}  # every complete target of the module aliased so far
        for held in self.handle_modules.values():
            for module in held:
                self.module_left[id(module)] = self.module_left.get(id(module), 0) + 1
                self.module_aliased[id(module)] = True
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # pieces waiting for the rest
        self.left = {t.name: len(t.sources) for t in targets}  # pieces still to come, per target
        self.aliased_bytes = 0
        self.copied_borrowed_bytes = 0  # borrowed memory a layer kept: copied (see ``borrowed``)
        self._borrowed: set[int] = set()  # storages of the tensors handed to add() (when ``borrowed``)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.borrowed:
            self._borrowed.add(tensor.untyped_storage().data_ptr())
        target_name, row, rows = self.plan[name]
        target = self.targets[target_name]
        param = self.params[target_name]
        in_place = param.numel() == math.prod(target.shape)
        if self.alias or not in_place:
            self.pending.setdefault(target_name, []).append((row, tensor))
        else:  # copy now: over IPC the bucket goes back to the learner once loaded
            param.data[row : row + rows].copy_(tensor)
            if target.pad_rows and row + rows == sum(target.piece_rows):
                param.data[row + rows :].zero_()
        self.left[target_name] -= 1
        if self.left[target_name]:
            return
        aliased = target_name in self.pending and self._join_pieces(target_name, target, param, in_place)
        self._layers_after(target_name, aliased)
        if self.borrowed and not in_place and not self.handle_modules[target_name]:
            self._own(param)

    def _join_pieces(self, target_name: str, target: TargetParam, param: torch.Tensor, in_place: bool) -> bool:
        """The target's last piece is in: join its pieces and put them in ``param`` (as a view of them where it
        may alias them, else copied). Whether it aliases them."""
        aliased = False
        pieces = [t for _, t in sorted(self.pending.pop(target_name), key=lambda item: item[0])]
        # The scratch is rewritten by the next join: only for a layer that prepacks (copies) it right now.
        prepacks_now = (
            not self.defer
            and bool(self.handle_modules[target_name])
            and all(self.module_left[id(m)] == 1 for m in self.handle_modules[target_name])
        )
        if prepacks_now:
            join = self.scratch
        else:
            join = self.joins.setdefault(target_name, StackScratch()) if self.defer else None
        stacked = stack_rows(pieces, join)
        if self.alias and aliases(stacked, pieces, target, param.dtype):
            view = stacked.view(target.shape)
            if param.data_ptr() != view.data_ptr() or param.shape != view.shape or param.stride() != view.stride():
                param.data = view  # the Parameter object stays: a tied module sees it too
            aliased = True
            self.aliased_bytes += view.numel() * view.element_size()
        elif in_place:
            pushed_rows = sum(target.piece_rows)
            param.data[:pushed_rows].copy_(stacked)
            if target.pad_rows:
                param.data[pushed_rows:].zero_()
        else:
            param.data = stacked.to(param.dtype).view(target.shape)  # a transposed layout stays transposed
        return aliased

    def _layers_after(self, target_name: str, aliased: bool) -> None:
        """A target is complete: each layer computing through a kernel handle whose targets are now all in gets
        its handle (the plain ``linear`` when every one aliases, a pending one when deferred, else made anew)."""
        for module in self.handle_modules[target_name]:
            key = id(module)
            self.module_aliased[key] = self.module_aliased[key] and aliased
            self.module_left[key] -= 1
            if self.module_left[key] == 0:
                if self.module_aliased[key]:
                    module.cpu_linear = torch.nn.functional.linear
                elif self.defer and module.weight.dim() == 2:
                    module.cpu_linear = PendingHandle(module, replaces=module.cpu_linear)
                    self.deferred.append(module)
                else:  # vLLM-CPU computes with a handle holding its own packed copy of the weight: make it anew
                    _contiguous_unless_prepacked(module)
                    module.quant_method.process_weights_after_loading(module)
                    if self.borrowed or self.scratch is not None:
                        self._own_weights(module)

    def _own_weights(self, module: torch.nn.Module) -> None:
        """After a layer set up its kernel from borrowed memory: copy what it kept pointing into it (vLLM's
        plain ``linear`` fallback keeps the weight itself; oneDNN handles and packed kernels hold copies)."""
        for param in module.parameters(recurse=False):
            self._own(param)

    def _own(self, param: torch.Tensor) -> None:
        if param.numel() and self._not_ours(param):
            param.data = param.data.clone()
            self.copied_borrowed_bytes += param.numel() * param.element_size()

    def _not_ours(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory no parameter may keep: the sender's, or the join scratch."""
        borrowed = tensor.untyped_storage().data_ptr() in self._borrowed
        return borrowed or (self.scratch is not None and self.scratch.holds(tensor))

    def add_all(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            self.add(name, tensor)

    def in_place_copies(
        self, pairs: Sequence[tuple[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None:
        """``(destinations, sources, padding)``: the parameter rows each pushed tensor is copied into and the
        padding rows to zero, when every parameter takes its pieces in place and no layer computes through a
        kernel handle of its own (a GPU engine); else None (use :meth:`add_all`). ``pairs`` must be the
        whole push."""
        if self.alias or any(self.handle_modules.values()):
            return None
        if {name for name, _ in pairs} != set(self.plan):
            raise RuntimeError(f"the push carries {len(pairs)} tensors; the direct-load plan expects {len(self.plan)}")
        destinations, sources = [], []
        for name, tensor in pairs:
            target_name, row, rows = self.plan[name]
            param = self.params[target_name]
            if param.numel() != math.prod(self.targets[target_name].shape):
                return None
            destinations.append(param.data[row : row + rows])
            sources.append(tensor)
        padding = [self.params[t.name].data[sum(t.piece_rows) :] for t in self.targets.values() if t.pad_rows]
        return destinations, sources, padding

    def finish(self) -> None:
        missing = [name for name, left in self.left.items() if left]
        if missing:
            raise RuntimeError(f"direct load incomplete: {missing[0]} and {len(missing) - 1} more got no data")


class PendingHandle:
    """A CPU layer's ``cpu_linear`` while its kernel handle is not made (a deferring :class:`DirectLoader`):
    called as vLLM calls ``cpu_linear``, it makes the handle from the layer's weight as received (vLLM's own
    ``process_weights_after_loading``, which puts the handle in ``cpu_linear``) and computes through it. So the
    reorder runs in the engine's first step after a push, on the thread that runs the model, instead of
    inside the push the learner waits for.

    It also holds the handle it ``replaces`` until then: freeing the old handles' packed weights took 16 ms of
    a profiled 138-ms receive on a one-core engine with SmolLM2-135M's 121 linear layers
    (``release_dnnl_matmul_handler``; ``bench/weight_push.py --transport gloo``, ``cProfile`` in the engine's
    worker), so each is let go when its layer's new handle is made. A layer not called between two pushes (an
    embedding, which looks its rows up without its handle; or no step between the pushes) lets go of the handle
    in the second push instead: replacing a pending handle keeps nothing, so no layer holds an old handle for
    longer than one push."""

    def __init__(self, module: Any, replaces: Any = None) -> None:  # a vLLM layer: ``cpu_linear``, ``quant_method``
        self.module = module
        self.replaced: Any = None if isinstance(replaces, PendingHandle) else replaces

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        make_handle(self.module)
        self.replaced = None  # the old handle's packed weights are freed here, after the push
        return self.module.cpu_linear(x, self.module.weight, bias)


def make_handle(module: Any) -> None:
    """vLLM-CPU's kernel handle for ``module`` from its weight as it is now (outside inference mode, which the
    engine's forward runs in: the method replaces parameters)."""
    with torch.inference_mode(False):
        _contiguous_unless_prepacked(module)
        module.quant_method.process_weights_after_loading(module)


def layerwise_reload(
    model: Any, vllm_config: Any, feed: Callable[[Callable], tuple[float, float]]
) -> tuple[float, float]:
    """vLLM's layerwise reload around ``feed``, which hands the pushed ``(name, tensor)`` pairs to the load
    function it is given and returns the seconds it spent waiting and loading."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    with set_current_vllm_config(vllm_config):
        initialize_layerwise_reload(model)
        waiting, loading = feed(lambda pairs: model.load_weights(weights=iter(pairs)))
        mark = time.perf_counter()
        finalize_layerwise_reload(model, vllm_config.model_config)
        loading += time.perf_counter() - mark
    return waiting, loading
