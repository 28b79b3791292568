"""The mode interface. The base class *is* fp32 training: every hook is a no-op or plain fp32.

A concrete mode overrides only what it changes (modelled on Lightning Fabric's precision
plugins). ``keep_fp32`` is honoured through one predicate, :meth:`PrecisionMode.keeps_fp32`,
and ``autoprec.modes.islands``, whose hooks make the kept modules run in fp32 whatever the
surrounding precision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from typing_extensions import override

from autoprec.eligibility import Situation, mode_eligibility, optimizer_8bit_eligibility
from autoprec.optim import (
    NamedGroup,
    OptimizerTarget,
    check_translation,
    rebuild_optimizer,
    translation_problem,
)
from autoprec.specs import ModeName, ModeSpec, matches_keep_fp32
from autoprec.state_translation import accept_source_state, refuse_unloadable_state

__all__ = ["PrecisionMode", "override"]


@contextlib.contextmanager
def float32_matmul_precision(tf32: bool) -> Iterator[None]:
    """Allow (or forbid) TF32 for fp32 matmuls, convolutions and cuDNN RNNs inside the block
    only; on the CPU (oneDNN) fp32 stays fp32 either way. ``torch.set_float32_matmul_precision
    ("medium")`` sets oneDNN's fp32 matmuls to bf16 where the CPU has bf16 units (AMX,
    avx512_bf16): left alone, the fp32 reference ran bf16 matmuls (0.166 off exact fp32 on a
    64x256 @ 256x256). Set through the calls that keep torch's legacy and per-backend flags
    consistent: setting the per-backend fields alone made torch's own getters raise ("a mix of
    the legacy and new APIs") inside the block (inductor's max-autotune reads them), and left
    cuDNN's RNNs at their TF32 default under the fp32 reference."""
    backends = torch.backends
    with matmul_precision_kept():
        if not hasattr(backends.cuda.matmul, "fp32_precision"):  # pragma: no cover - torch < 2.9
            backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = tf32
        else:
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            backends.cudnn.allow_tf32 = tf32  # convolutions and RNNs
            backends.mkldnn.matmul.fp32_precision = backends.mkldnn.conv.fp32_precision = "ieee"
        yield


@contextlib.contextmanager
def matmul_precision_kept() -> Iterator[None]:
    """torch's fp32 precision settings as they were after the block, whatever it set: the
    per-backend fields, the global setting and cuDNN's legacy flag, put back in the order
    that keeps torch's getters readable (a user's "high" left unreadable by
    ``torch.get_float32_matmul_precision()``; ``cudnn.allow_tf32`` raising "a mix of the
    legacy and new APIs": both found by hunts)."""
    backends = torch.backends
    if not hasattr(backends.cuda.matmul, "fp32_precision"):  # pragma: no cover - torch < 2.9
        saved_legacy = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)
        try:
            yield
        finally:
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved_legacy
        return
    fields = [
        backends,
        backends.cuda.matmul,
        backends.cudnn,
        backends.cudnn.conv,
        backends.cudnn.rnn,
        backends.mkldnn,
        backends.mkldnn.matmul,
        backends.mkldnn.conv,
    ]
    saved = [field.fp32_precision for field in fields]
    try:  # the user's "high" / "medium": raises when they set per-backend fields themselves
        saved_global: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        saved_global = None
    try:
        saved_cudnn: bool | None = backends.cudnn.allow_tf32
    except RuntimeError:
        saved_cudnn = None
    try:
        yield
    finally:
        # the global setter first (it writes torch's legacy flag too), cuDNN's legacy flag,
        # then every field as it was: the fields alone left a user's "high" readable by the
        # fields and not by torch.get_float32_matmul_precision() (Lightning's CUDA
        # accelerator reads it), and cudnn.allow_tf32 False beside conv/rnn's "tf32"
        if saved_global is not None:
            torch.set_float32_matmul_precision(saved_global)
        if saved_cudnn is not None:
            backends.cudnn.allow_tf32 = saved_cudnn
        for field, value in reversed(list(zip(fields, saved, strict=True))):
            field.fp32_precision = value


@contextlib.contextmanager
def swaps_under_every_name(model: nn.Module) -> Iterator[None]:
    """Around a module swap that walks ``named_modules()`` (each module once, under its first
    name) or each parent's children (each parent its own copy): afterwards every name of a
    swapped module points at one replacement. FP8 swapped a Linear registered twice
    (``self.b = self.a``) under its first name only, splitting the user's one module in two,
    half its calls in FP8 and half in bf16 (found by a hunt)."""
    before = dict(model.named_modules(remove_duplicate=False))
    yield
    after = dict(model.named_modules(remove_duplicate=False))
    replaced: dict[int, nn.Module] = {}  # each original module's first replacement
    for fqn, module in after.items():
        if fqn in before and module is not before[fqn]:
            replaced.setdefault(id(before[fqn]), module)
    originals = {id(module): module for module in before.values()}
    for original_id, first in replaced.items():
        # public attributes a Linear carries (build-nanogpt's NANOGPT_SCALE_INIT marker):
        # the swap made a new module without them (found by a review)
        for name, value in vars(originals[original_id]).items():
            if not name.startswith("_") and name not in vars(first):
                setattr(first, name, value)
    for fqn, module in after.items():
        first = replaced.get(id(before[fqn])) if fqn in before else None
        # a name still holding the original, or holding another replacement of it: a Linear
        # registered under two parents was swapped by each, into two modules (found by a
        # hunt: a hook on one never fired, the forward calling the other)
        if fqn and first is not None and module is not first:
            parent_name, _, child_name = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child_name, first)


BackwardRunner = Callable[[torch.Tensor], None]
"""Runs the backward pass of a (scaled) loss: ``Tensor.backward`` unless a trainer has its own."""


def tensor_backward(loss: torch.Tensor) -> None:
    loss.backward()


def under_root(fqn: str, roots: Collection[str]) -> bool:
    """Whether module ``fqn`` is one of ``roots`` or inside one: its ancestors looked up in
    ``roots`` (a set or dict), so the cost grows with the nesting depth. Comparing every
    module with every root made ``prepare()`` quadratic in the kept modules: 19 s at 4000
    kept LayerNorms under pure bf16 (found by a hunt)."""
    if fqn in roots:
        return True
    end = fqn.rfind(".")
    while end > 0:
        if fqn[:end] in roots:
            return True
        end = fqn.rfind(".", 0, end)
    return False


class PrecisionMode:
    """Full fp32 training, TF32 off: the reference every other mode is measured against."""

    name: ClassVar[ModeName] = "fp32"
    optimizer_target: ClassVar[OptimizerTarget | None] = None
    """Which optimizer implementation the mode needs; None keeps the user's."""
    state_rounding: ClassVar[Literal["nearest", "stochastic"]] = "nearest"
    """How the optimizer writes states kept in a low-precision dtype (bf16 parameters make
    torch's Adam keep its moments in bf16, rounded to nearest)."""
    fp32_second_moment: ClassVar[bool] = False
    """Adam's second moment kept in fp32 beside bf16 weights (bf16_kahan)."""

    def __init__(self, spec: ModeSpec) -> None:
        if spec.mode != self.name:
            raise ValueError(f"{type(self).__name__} runs mode {self.name!r}, not {spec.mode!r}.")
        self.spec = spec
        self.device_type = "cpu"

    # -- eligibility --------------------------------------------------------------------------

    def requirements(self, situation: Situation) -> list[str]:
        """Every reason this mode (with its knobs) cannot run in ``situation``; empty if it can."""
        reasons = list(mode_eligibility(self.name, situation).reasons)
        if self.spec.optimizer_bits == 8:  # bitsandbytes' states, or its quantisation (bf16_sr)
            reasons.extend(optimizer_8bit_eligibility(situation).reasons)
        return reasons

    # -- keep_fp32 ----------------------------------------------------------------------------

    def keeps_fp32(self, fqn: str) -> bool:
        """True when module ``fqn`` (or an ancestor) matches a ``keep_fp32`` pattern."""
        return matches_keep_fp32(fqn, self.spec.keep_fp32)

    def skips_fp8(self, fqn: str) -> bool:
        """True when module ``fqn`` (or an ancestor) matches an ``fp8_skip`` pattern."""
        return matches_keep_fp32(fqn, self.spec.fp8_skip)

    def module_filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """torchao's idiom: True when the mode may convert this module."""
        return not self.keeps_fp32(fqn)

    kept_out_of_fp8: frozenset[int] = frozenset()
    """FP8 modes: ids of the modules kept in fp32 or skipped from FP8 under *any* of their
    names, read at conversion (``read_out_of_fp8``)."""

    def read_out_of_fp8(self, model: nn.Module) -> None:
        """Set ``kept_out_of_fp8`` for ``model``: a Linear registered twice (``enc.1`` and
        ``dec.0``) was filtered by its first name alone, and ran in FP8 inside a kept ``dec``
        (found by a hunt)."""
        self.kept_out_of_fp8 = frozenset(
            id(module)
            for fqn, module in model.named_modules(remove_duplicate=False)
            if fqn and (self.keeps_fp32(fqn) or self.skips_fp8(fqn))
        )

    def fp8_modules(self, model: nn.Module) -> tuple[str, ...]:
        """Names of the modules this mode runs in FP8 (after ``convert_module``)."""
        return ()

    def kept_modules(self, model: nn.Module) -> set[str]:
        """Modules kept in fp32: those matching a ``keep_fp32`` pattern. A module tied to one
        (a ``lm_head`` sharing ``wte``'s weight) is not kept: it computes in the mode's
        precision from the shared fp32 weight (pure bf16: :meth:`tied_to_kept`)."""
        return {fqn for fqn, _ in model.named_modules() if fqn and self.keeps_fp32(fqn)}

    def kept_roots(self, model: nn.Module) -> list[str]:
        """The outermost kept modules (hooking those covers their children). A ModuleList or
        ModuleDict is never called, so its hooks never fire: its children are the roots (a
        kept ``blocks`` list computed in bf16 under AMP and failed under pure bf16; found by a
        hunt)."""
        kept = self.kept_modules(model)
        roots: dict[str, None] = {}
        for fqn, module in model.named_modules():
            if fqn not in kept or under_root(fqn, roots):
                continue
            if not isinstance(module, nn.ModuleList | nn.ModuleDict):
                roots[fqn] = None
        return list(roots)

    def tied_to_kept(self, model: nn.Module) -> list[str]:
        """Modules outside ``keep_fp32`` that hold a parameter of a kept module (weight tying):
        where a mode casts parameters, that shared parameter stays fp32."""
        kept = self.kept_roots(model)
        shared = self.parameter_ids(model, kept)
        roots = set(kept)
        return [
            fqn
            for fqn, module in model.named_modules()
            if fqn
            and not under_root(fqn, roots)
            and any(id(p) in shared for p in module.parameters(recurse=False))
        ]

    @staticmethod
    def parameter_ids(model: nn.Module, roots: list[str]) -> set[int]:
        """ids of the parameters of the ``roots`` modules (and their children)."""
        return {id(p) for fqn in roots for p in model.get_submodule(fqn).parameters()}

    # -- conversion ---------------------------------------------------------------------------

    def convert_module(self, model: nn.Module) -> nn.Module:
        """Cast and swap modules in place; returns the model to train."""
        parameter = next(model.parameters(), None)
        self.device_type = "cpu" if parameter is None else parameter.device.type
        return model

    @property
    def rebuilt_optimizer_target(self) -> OptimizerTarget | None:
        """The implementation this mode rebuilds the user's optimizer as; None: it keeps it.
        8-bit states: bitsandbytes', or the mode's own optimizer with 8-bit moments (bf16_sr)."""
        if self.spec.optimizer_bits != 8:
            return self.optimizer_target
        return "stochastic_8bit" if self.optimizer_target == "stochastic" else "bnb_8bit"

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise what rebuilding ``optimizer`` for this mode would raise (its class, an option
        without an equivalent), before anything is converted."""
        target = self.rebuilt_optimizer_target
        if target is not None:
            check_translation(optimizer, target)
            refuse_unloadable_state(optimizer, target)  # a stepped optimizer's state

    def optimizer_problem(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Why this mode cannot rebuild ``optimizer`` (its class or options), or None."""
        target = self.rebuilt_optimizer_target
        return None if target is None else translation_problem(optimizer, target)

    def convert_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, groups: list[NamedGroup]
    ) -> torch.optim.Optimizer:
        """The optimizer this mode trains with, over ``model``'s (possibly new) parameters. An
        optimizer that has stepped (a run switched mid-way) keeps its state: loaded into the
        rebuild (translated where that is another library's), or, where the mode keeps the
        optimizer, cast to its parameters' new dtypes as torch's own load casts it (bf16_pure
        stepped with fp32 state on bf16 weights failed in ``lerp``)."""
        held = optimizer.state_dict() if optimizer.state else None
        target = self.rebuilt_optimizer_target
        if target is None:
            current = {id(p) for p in model.parameters()}
            kept = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if kept <= current:  # nothing swapped: keep the user's optimizer
                if held is not None:
                    optimizer.load_state_dict(held)
                accept_source_state(optimizer, optimizer, None)  # resumes other modes' saves
                return optimizer
            target = "same"
        rebuilt = rebuild_optimizer(optimizer, groups, model, target, require_fresh=False)
        accept_source_state(rebuilt, optimizer, target)  # a run switched between modes resumes
        if held is not None:
            rebuilt.load_state_dict(held)
        return rebuilt

    # -- training step ------------------------------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return float32_matmul_precision(tf32=False)

    def backward(self, loss: torch.Tensor, run: BackwardRunner = tensor_backward) -> None:
        """The backward pass of ``loss`` as the mode takes it (fp16: scaled; pure bf16 with
        accumulation: summed in fp32 after), the pass itself by ``run`` (a trainer's own:
        Lightning's ``LightningModule.backward`` hook, ``manual_backward``'s arguments)."""
        with float32_matmul_precision(tf32=False):
            run(loss)

    def settle(self, compute_loss: Callable[[], torch.Tensor], model: nn.Module) -> None:
        """Calibrate before training starts, without stepping (amp_fp16: the loss scale)."""

    def configure_accumulation(self, steps: int) -> None:
        """Told by the plan how many micro-batches make one optimizer step."""

    def accumulation_bytes(self) -> int:
        """Bytes of gradient sums the mode keeps beside ``.grad`` (0: none)."""
        return 0

    def gradients_ready(self) -> None:
        """The last micro-batch's backward is done: make ``.grad`` hold the whole step's
        gradients (a mode that accumulates elsewhere writes them back here)."""

    def keeps_gradient_state(self) -> bool:
        """Whether the mode keeps something about the gradients beside ``.grad`` that the
        optimizer's ``zero_grad`` must drop too (see discard_accumulated)."""
        return type(self).discard_accumulated is not PrecisionMode.discard_accumulated

    def discard_accumulated(self) -> None:
        """The optimizer's ``zero_grad`` dropped the gradients: drop what the mode keeps about
        them (sums beside ``.grad``, a record that they were unscaled). No-op for modes that
        keep nothing beside ``.grad``."""

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``.grad`` hold true gradients (before clipping). No-op without loss scaling."""

    def loss_scale_tensor(self) -> torch.Tensor | None:
        """The loss scale as a device tensor (no host read); None without loss scaling."""
        return None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the loss scaler skipped: 0 without loss scaling (docs/runtime.md
        logs it for any mode; only amp_fp16 had it, an AttributeError elsewhere: a hunt)."""
        return 0

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (loss scaler found inf/nan)."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
