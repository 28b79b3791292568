"""Forward FLOPs by layer kind: one forward pass under a dispatch mode.

Every matmul, convolution and attention FLOP (``torch.utils.flop_counter`` formulas) is credited
to the innermost module kind it ran in; a matmul outside any such module whose operand is a
parameter held directly by a custom module (``x @ self.W``) counts as ``raw_param``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from autoprec.buffer_slots import (
    buffer_slots,
    empty_buffer_slots,
    kept_values,
    restore_buffer_slots,
)
from autoprec.layer_kinds import LAYER_KINDS, LayerKind, is_bnb_4bit, module_kind
from autoprec.own_autocast import OwnAutocastWatch
from autoprec.random_streams import kept_streams

_BNB_4BIT_MATMULS = frozenset({"bitsandbytes::gemm_4bit", "bitsandbytes::gemv_4bit"})
"""bitsandbytes' own ops for a 4-bit Linear's matmul (its CPU path; on CUDA it dequantizes and
runs an aten matmul, which torch's formulas count)."""


_FUSED_RNNS = (torch.ops.aten.mkldnn_rnn_layer, torch.ops.aten._cudnn_rnn)
"""An nn.LSTM's (and on CUDA, GRU's and RNN's) whole forward as one op, which torch's formulas
do not know: a 2-layer LSTM counted 0 FLOPs, and a Linear beside it 100% of the model's."""


def _fused_rnn_flops(args: Any) -> int:
    """Gate matmuls of a fused RNN op: 2 FLOPs per weight element per token (input and
    hidden weights; every layer and direction for cuDNN's whole-stack op, one for oneDNN's
    per-layer op). Elementwise gate math is left out, as for Linears."""
    source = args[0]
    tokens = source.numel() // max(int(source.shape[-1]), 1)
    weights = args[1] if isinstance(args[1], list | tuple) else args[1:3]  # cuDNN: every layer's
    return (
        2 * tokens * sum(w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2)
    )


class FlopAttribution(TorchDispatchMode):
    """Credits each FLOP-counted aten op to a layer kind, using a module stack kept by hooks."""

    def __init__(self, parameter_storages: dict[int, str]) -> None:
        super().__init__()
        self.parameter_storages = parameter_storages
        self.stack: list[tuple[str, LayerKind | None]] = []
        self.flops_by_kind: dict[LayerKind, int] = dict.fromkeys(LAYER_KINDS, 0)
        self.flops_by_module: dict[str, int] = {}
        self.raw_params: dict[str, None] = {}
        self.compute_order: dict[str, None] = {}
        """Compute layers in the order the forward first called them (an ordered set: a list's
        ``in`` made the probe quadratic, 1.85 s of hooks at 20k Linears; found by a hunt)."""
        self.autocast_at: str | None = None
        """The autocast the forward enters itself, where it was first seen
        (``autoprec.own_autocast``); None: none."""
        self.under_transform: dict[str, None] = {}
        """Linears called under ``torch.vmap`` or another ``torch.func`` transform (an ordered
        set): FP8 module swaps cannot run there."""
        self.called: dict[str, None] = {}
        """Every module the forward called (an ordered set)."""
        self.raw_at_end: tuple[str, ...] = ()
        """The raw parameters of the forward's last matmul where it came after every module's
        (a head tied to the embedding by ``F.linear(x, self.embed.weight)``); () otherwise."""

    def reset(self) -> None:
        """Forget what a failed forward counted, before another runs."""
        self.stack.clear()
        self.flops_by_kind = dict.fromkeys(LAYER_KINDS, 0)
        self.flops_by_module.clear()
        self.raw_params.clear()
        self.compute_order.clear()
        self.autocast_at = None
        self.under_transform.clear()
        self.called.clear()
        self.raw_at_end = ()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a dynamo-disable shim that imports torch._dynamo
        # (~2 s) on first use. The scan never compiles, so the shim buys nothing here.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = self._flops(func, args, kwargs, out)
        if flops:
            self._credit(flops, args)
        return out

    @staticmethod
    def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
        packet = func._overloadpacket
        if packet in flop_registry:
            return int(flop_registry[packet](*args, **kwargs, out_val=out))
        if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
            # CPU SDPA kernel; torch's flop registry knows only the CUDA ones.
            query, key, value = args[:3]
            return int(sdpa_flop_count(query.shape, key.shape, value.shape))
        if func.name() in _BNB_4BIT_MATMULS:
            # bitsandbytes' 4-bit Linear on CPU: out (..., N) = A (..., K) @ W(shapeB = (N, K)).T
            return 2 * out.numel() * int(args[2][1])
        if packet in _FUSED_RNNS:
            return _fused_rnn_flops(args)
        return 0

    def _credit(self, flops: int, args: Any) -> None:
        for fqn, kind in reversed(self.stack):
            if kind is not None:
                self.flops_by_kind[kind] += flops
                self.flops_by_module[fqn] = self.flops_by_module.get(fqn, 0) + flops
                self.raw_at_end = ()
                return
        operands = [
            (self.parameter_storages[key], arg.dim())
            for arg in args
            if isinstance(arg, torch.Tensor)
            and (key := storage_key(arg)) in self.parameter_storages
        ]
        if operands:
            self.flops_by_kind["raw_param"] += flops
            # addmm(bias, x, weight.t()): the bias is added, not multiplied; named only when
            # no matrix parameter is in the op (a vector a custom module multiplies)
            matrices = [name for name, dims in operands if dims >= 2]
            named = matrices or [name for name, _ in operands]
            self.raw_params.update(dict.fromkeys(named))
            self.raw_at_end = tuple(named)
        else:
            self.flops_by_kind["other"] += flops

    @contextmanager
    def tracking(self, model: nn.Module) -> Iterator[None]:
        handles = []
        for fqn, module in model.named_modules():
            kind = module_kind(module)

            def push(_module: nn.Module, _args: Any, fqn: str = fqn, kind: Any = kind) -> None:
                self.stack.append((fqn, kind))
                self.called[fqn] = None
                if kind in ("linear", "conv", "embedding"):
                    self.compute_order[fqn] = None
                if kind == "linear" and torch._C._functorch.maybe_current_level() is not None:
                    self.under_transform[fqn] = None

            def pop(_module: nn.Module, _args: Any, _out: Any) -> None:
                self.stack.pop()

            handles.append(module.register_forward_pre_hook(push))
            handles.append(module.register_forward_hook(pop))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def storage_key(tensor: torch.Tensor) -> int | None:
    """Identifies the storage a tensor views (None for subclasses without storage)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None  # tensor subclasses without storage


@dataclass(frozen=True)
class ModelCall:
    """The positional and keyword arguments of one call of a model (what a ``train_step``
    passed it), for a scan's forward to call it the same way."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def call_model(model: nn.Module, example_input: Any) -> Any:
    """``model(**mapping)``, ``model(*sequence)``, ``model(tensor)``, or a :class:`ModelCall`'s
    ``model(*args, **kwargs)``."""
    if isinstance(example_input, ModelCall):
        return model(*example_input.args, **example_input.kwargs)
    if isinstance(example_input, Mapping):
        return model(**example_input)
    if isinstance(example_input, tuple | list):
        return model(*example_input)
    return model(example_input)


@contextmanager
def renormed_weights_kept(model: nn.Module) -> Iterator[None]:
    """Put back the weights a forward pass rewrites in place: an ``nn.Embedding(max_norm=...)``
    renormalises the rows it looks up, in eval mode and without gradients too."""
    renormed = [
        module
        for module in model.modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.max_norm is not None
    ]
    kept = [module.weight.detach().clone() for module in renormed]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, weight in zip(renormed, kept, strict=True):
                module.weight.copy_(weight)


NEEDS_GRADIENTS = "does not have a grad_fn"
"""torch.autograd.grad's error on an output computed without gradients: the forward
differentiates by its inputs (forces as -dE/dpos, a physics residual) and cannot run without
them (found by a hunt: the probe's scan and every trial's held-out pass failed)."""


def run_forward(
    model: nn.Module,
    example_input: Any,
    attribution: FlopAttribution,
    *,
    training: bool,
    grad: bool = False,
) -> None:
    """One forward without gradients (with ``grad``: with them; nothing is stepped) under
    ``attribution``, in training mode (as trials and training run it) or eval mode; the
    model's modes, buffers and RNG are put back."""
    modes = {module: module.training for module in model.modules()}
    model.train(training)
    for module in modes:
        # bitsandbytes' Linear4bit repacks its weight for CPU inference on an eval-mode
        # no-grad forward, after which training it fails ("a view of a leaf Variable that
        # requires grad is being used in an in-place operation", bitsandbytes 0.50.2): left in
        # training mode, which changes nothing else in its forward
        module.training = module.training or is_bnb_4bit(module)
    # nn.MultiheadAttention (and TransformerEncoderLayer) take a fused fast path in eval mode
    # without grad, which torch's FLOP formulas do not see: the in-projection, attention and
    # out-projection counted 0. Training never takes it, so the scan does not either.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    # a forward that draws noise (a VAE) moved the caller's RNG, and a module updating its
    # buffers on every call (an observation normaliser) kept the scan's update (found by a
    # hunt): both are put back
    tensors = (*model.parameters(), *model.buffers())
    cuda = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    slots, empty = buffer_slots(model), empty_buffer_slots(model)
    values = kept_values(slots)
    try:
        tracked = attribution.tracking(model)
        streams = kept_streams(cuda)
        watch = OwnAutocastWatch(model)
        grads = torch.enable_grad() if grad else torch.no_grad()
        with streams, grads, renormed_weights_kept(model), tracked, attribution, watch:
            call_model(model, example_input)
        attribution.autocast_at = watch.found
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        for module, training in modes.items():
            module.training = training
        restore_buffer_slots(model, slots, values, empty)
