"""What kind of layer a module is, and whether FP8 kernels can take (and pay for) a Linear."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from autoprec._wording import first_names
from autoprec.specs import matches_keep_fp32

LayerKind = Literal["linear", "conv", "embedding", "norm", "recurrent", "raw_param", "other"]
LAYER_KINDS: tuple[LayerKind, ...] = (
    "linear",
    "conv",
    "embedding",
    "norm",
    "recurrent",
    "raw_param",
    "other",
)

FP8_DIM_MULTIPLE = 16
"""FP8 GEMM kernels (torch._scaled_mm, Transformer Engine) need both Linear dims divisible by 16."""

MXFP8_BLOCK = 32
"""MXFP8 scales blocks of 32 elements: TE's ``MXFP8Quantizer`` needs both dimensions of a
Linear divisible by 32, where the other FP8 recipes need 16."""

BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps optimizer state of tensors smaller than this in 32 bit (min_8bit_size)."""

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 family: ``c_attn``, ``c_proj``, ``c_fc``): a Linear
    whose weight is stored (in, out), ``y = x @ W + b``; not an nn.Linear subclass."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_bnb_4bit(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit Linear (``Linear4bit``, ``LinearNF4``, ``LinearFP4``: QLoRA's frozen
    base), recognised without importing bitsandbytes."""
    return any(
        cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")
        for cls in type(module).__mro__
    )


def is_uncalled_linear(module: nn.Module) -> bool:
    """nn.MultiheadAttention's ``out_proj`` (torch's NonDynamicallyQuantizableLinear): its owner
    multiplies the weight itself (``F.multi_head_attention_forward``) and never calls the Linear,
    so a module swap (FP8) does not reach its matmul, and its FLOPs are its owner's. Counted as
    the owner's raw parameters, like ``in_proj_weight`` beside it (it was counted as a Linear
    whose FLOPs went to raw parameters, and an FP8 swap of it was listed as a layer run in
    FP8)."""
    return isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)


def uncalled_kept_module(model: nn.Module, keeps: Callable[[str], bool]) -> str | None:
    """Why a module ``keeps`` (a keep_fp32 test of module names) keeps apart from its owner
    cannot run in fp32, or None. An fp32 island hooks the module's own calls; nothing calls
    nn.MultiheadAttention's ``out_proj`` (:func:`is_uncalled_linear`) or a ParameterList /
    ParameterDict (their owner computes with their tensors), so keeping one kept nothing
    under AMP, without a word, and failed under pure bf16 ("mat1 and mat2 must have the same
    dtype"; found by a hunt)."""
    for fqn, module in model.named_modules():
        owner = fqn.rpartition(".")[0]
        if not fqn or not keeps(fqn) or (owner and keeps(owner)):
            continue
        if is_uncalled_linear(module) or isinstance(module, nn.ParameterList | nn.ParameterDict):
            what = (
                "nn.MultiheadAttention's out_proj, whose owner multiplies its weight itself"
                if is_uncalled_linear(module)
                else f"an nn.{type(module).__name__}, whose tensors its owner computes with"
            )
            instead = (
                f"Keep its owner {owner!r} instead"
                if owner
                else "Its owner is the model's root module, which cannot be kept apart from the "
                "model: leave it out of keep_fp32"
            )
            return (
                f"keep_fp32 keeps {fqn!r} apart from its owner, but it is {what}: it is never "
                f"called, so nothing of it can run in fp32 alone. {instead}."
            )
    return None


def second_name_refusal(model: nn.Module, pattern: str, field: str = "keep_fp32") -> str | None:
    """Why ``pattern`` cannot be used when it names a module only by its second name
    (``self.head = self.blocks[-1]``): ``named_modules()`` gives each module once, under its
    first name, which ``keep_fp32`` and ``fp8_skip`` match; None when it names a first name
    or nothing."""
    first_names_of = {id(module): fqn for fqn, module in model.named_modules()}
    if any(matches_keep_fp32(fqn, (pattern,)) for fqn in first_names_of.values() if fqn):
        return None
    for fqn, module in model.named_modules(remove_duplicate=False):
        if fqn and matches_keep_fp32(fqn, (pattern,)) and first_names_of[id(module)] != fqn:
            first = first_names_of[id(module)]
            return (
                f"{field} pattern {pattern!r} names {fqn!r}, a second name of the module "
                f"{first!r}: model.named_modules() lists each module once, under its first "
                f"name, and {field} matches those. Use {first!r}."
            )
    return None


def unknown_name_refusal(model: nn.Module, pattern: str, field: str = "keep_fp32") -> str | None:
    """Why ``pattern`` names no module ``keep_fp32``/``fp8_skip`` can reach: a second name
    (:func:`second_name_refusal`), or no name at all (with the model's modules and the closest
    names); None when it matches a module's first name."""
    names = [fqn for fqn, _ in model.named_modules() if fqn]
    matched = [fqn for fqn in names if matches_keep_fp32(fqn, (pattern,))]
    if matched:
        return _parametrization_refusal(matched, pattern, field)
    second_name = second_name_refusal(model, pattern, field)
    if second_name:
        return second_name
    close = difflib.get_close_matches(pattern, names, n=3)
    more = f" and {len(names) - 12} more" if len(names) > 12 else ""
    shown = ", ".join(names[:12]) + more
    hint = f"Did you mean {', '.join(map(repr, close))}? " if close else ""
    return (
        f"{field} pattern {pattern!r} matches no module of {type(model).__name__} "
        f"(its modules: {shown or 'none below the root'}). {hint}Use names as "
        "model.named_modules() gives them; `autoprec probe --model ...` lists the layers."
    )


def _owner(fqn: str) -> str:
    """The module a parametrization container (``b.parametrizations.weight``) belongs to."""
    parts = fqn.split(".")
    return ".".join(parts[: parts.index("parametrizations")])


def _parametrization_refusal(matched: list[str], pattern: str, field: str) -> str | None:
    """Why ``pattern`` cannot be used when a module it names itself (not through an
    ancestor) is a parametrization's container (``torch.nn.utils.parametrize``:
    ``b.parametrizations`` or ``b.parametrizations.weight``): it computes a weight its owner
    uses, and kept, the trained ``original`` it holds was cast to bf16 while only a buffer
    stayed fp32 (found by a hunt). A module inside one (a LoRA adapter written as a
    parametrization, ``b.parametrizations.weight.0``) keeps what it holds (a review). None
    otherwise."""
    named = [fqn for fqn in matched if fqn == pattern or fnmatch.fnmatchcase(fqn, pattern)]
    containers = [
        fqn
        for fqn in named
        if "parametrizations" in fqn.split(".")[-2:]
        and not matches_keep_fp32(_owner(fqn), (pattern,))  # ``encoder.*`` keeps the owner
    ]
    if not containers:  # ``b.parametrizations.*`` names the container alone: refused (a review)
        return None
    owner = _owner(containers[0])
    shown = repr(owner) if owner else "the model itself (keep_fp32 cannot name the root)"
    return (
        f"{field} pattern {pattern!r} names {containers[0]!r}, a parametrization "
        f"(torch.nn.utils.parametrize) computing a weight of {shown}: it runs as part of its "
        f"owner, and named alone only part of it was kept. Name the owner instead."
    )


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or an HF Conv1D."""
    if is_hf_conv1d(module):
        return int(module.nx), int(module.nf)
    return int(module.in_features), int(module.out_features)


def module_kind(module: nn.Module) -> LayerKind | None:
    """The layer kind of a module, or None for containers and custom modules. HF ``Conv1D``
    counts as a Linear (it is one, with a transposed weight)."""
    if is_uncalled_linear(module):
        return None
    if isinstance(module, nn.Linear) or is_hf_conv1d(module):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "conv"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return "embedding"
    if isinstance(module, _NORM_TYPES):
        return "norm"
    if isinstance(module, nn.RNNBase | nn.RNNCellBase):
        # nn.LSTM/GRU/RNN and their cells: their weights are module parameters used by
        # fused RNN ops (or addmm on a CPU), not raw parameters a custom module multiplies.
        return "recurrent"
    if (
        _NORM_NAME.search(type(module).__name__)
        and next(module.children(), None) is None
        and type(module).__module__ != _PARAMETRIZATIONS
    ):
        # Custom norms (LlamaRMSNorm, T5LayerNorm, LayerNorm2d, FrozenBatchNorm2d,
        # RMSNormalization, ...) are recognised by name; a wrapper such as
        # ``PreNorm(dim, fn)`` has children and is not a norm itself; torch's
        # parametrizations (_WeightNorm, _SpectralNorm) reparametrize a weight, normalising
        # no activation: no statistics to keep in fp32.
        return "norm"
    return None


_NORM_NAME = re.compile(r"(Norm|Normalization)([123][dD])?$")
"""A custom norm's class name: ending "Norm" alone missed SAM's and ConvNeXt's LayerNorm2d,
which then computed its statistics in bf16 under pure bf16, 0.39 off fp32's output (found by
a hunt)."""
_PARAMETRIZATIONS = "torch.nn.utils.parametrizations"


def fp8_worthwhile(in_features: int, out_features: int, recipe: str = "tensorwise") -> bool:
    """Whether an FP8 Linear of this shape is likely to be faster than bf16 on an H100.

    torchao's own auto-filters (from its H100 benchmarks), K = in_features, N = out_features:
    tensorwise skips K <= 4096 and N <= 1024; rowwise skips N <= 2048, K <= 1024, or
    N <= 4096 and K <= 2048.
    """
    if recipe == "rowwise":
        return not (
            out_features <= 2048
            or in_features <= 1024
            or (out_features <= 4096 and in_features <= 2048)
        )
    return not (in_features <= 4096 and out_features <= 1024)


def computes_weight(module: nn.Module) -> bool:
    """Is the module's ``weight`` computed at each call rather than a Parameter of its own (a
    torch parametrization such as ``weight_norm`` or ``spectral_norm``, or their hook-based
    forms in ``torch.nn.utils``)? Read from the module's parameter table: reading ``weight``
    itself runs the parametrization, and spectral norm's then advances its power iteration in
    place (the probe and ``apply()`` moved a user's vectors that way; found by a hunt)."""
    return not isinstance(module._parameters.get("weight"), nn.Parameter)


def is_fp8_linear(module: nn.Module) -> bool:
    """A Linear already converted to FP8 (torchao's ``Float8Linear``): a model the user
    converted before autoprec saw it."""
    return type(module).__module__.startswith("torchao.") and "Float8" in type(module).__name__


_HOOK_TABLES = (
    "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)  # fmt: skip
"""A module's hooks besides its forward ones, which an FP8 swap drops too."""
_SWAP_SETS = frozenset({
    "config", "linear_mm_config", "scaling_type_input", "scaling_type_weight",
    "scaling_type_grad_output",
})  # fmt: skip
"""Instance attributes torchao's ``Float8Linear`` (0.18) sets on itself: a Linear carrying one
of its own would lose it to the swap."""
_HARMLESS_OVERRIDES = frozenset({"__init__", "reset_parameters", "extra_repr", "__repr__"})
"""A Linear subclass's methods no training step calls: a swap may drop them."""


def swap_would_drop(module: nn.Module) -> str | None:
    """What an FP8 module swap (torchao's ``Float8Linear.from_float``, Transformer Engine's
    Linear) would drop from this Linear, or None: it keeps ``weight`` and ``bias`` and runs
    ``nn.Linear``'s own forward, so a subclass's forward (LoRA's adapters, a scale, dropout)
    or other methods (a ``_load_from_state_dict`` remapping keys), a forward set on the
    instance, its other parameters, buffers or submodules, and hooks registered on it
    (forward, backward, state-dict) were lost without a word (found by hunts: a LoRA Linear
    failed with the model half converted; a subclass scaling its output by 10 trained
    unscaled, called safe; a backward hook never fired again). Public attributes are carried
    onto the replacement (``modes.base.swaps_under_every_name``)."""
    if is_fp8_linear(module):
        return f"it is already an FP8 module ({type(module).__name__})"
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has its own forward"
    if "forward" in vars(module):
        return "its forward is set on the instance (an accelerate or PEFT hook?)"
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
    extra += [n for n, _ in module.named_buffers(recurse=False)]
    extra += [n for n, _ in module.named_children()]
    if extra:
        return f"{type(module).__name__} holds {', '.join(extra)} beside weight and bias"
    if module._forward_hooks or module._forward_pre_hooks:
        return "forward hooks are registered on it"
    hooks = [table.strip("_") for table in _HOOK_TABLES if getattr(module, table, None)]
    if hooks:
        return f"{', '.join(hooks)} are registered on it"
    mro = type(module).__mro__
    own = [
        name
        for cls in mro[: mro.index(nn.Linear)]
        for name, value in vars(cls).items()
        if callable(value) and name not in _HARMLESS_OVERRIDES
    ]
    if own:
        return f"{type(module).__name__} defines {', '.join(own)}"
    taken = sorted(set(vars(module)) & _SWAP_SETS)
    if taken:  # a user's ``config`` would be lost under torchao's own (found by a review)
        return f"its attributes {', '.join(taken)} are names the FP8 module sets itself"
    return None  # other public attributes go onto the replacement (``swaps_under_every_name``)


def fp8_linear_fits(module: nn.Module) -> bool:
    """An nn.Linear whose both dimensions FP8 GEMM kernels take (an HF Conv1D is not: FP8
    module swaps convert nn.Linear only; nor is a bitsandbytes 4-bit Linear, whose packed
    uint8 weight a Float8Linear would multiply as it is; nor a Linear whose weight is computed,
    which a swap cannot take: torchao raised TypeError with the model half converted; nor
    nn.MultiheadAttention's out_proj, which its owner never calls; nor one whose forward,
    other tensors or hooks a swap would drop: :func:`swap_would_drop`; nor a float64 one, held
    so on purpose: FP8 moved a frozen float64 Linear's outputs 5.6%, a review)."""
    return (
        isinstance(module, nn.Linear)
        and not is_uncalled_linear(module)
        and not is_bnb_4bit(module)
        and not computes_weight(module)  # before the dtype: reading a parametrized weight runs
        and module.weight.dtype != torch.float64  # its parametrization (a power iteration)
        and swap_would_drop(module) is None
        and module.in_features % FP8_DIM_MULTIPLE == 0
        and module.out_features % FP8_DIM_MULTIPLE == 0
    )


def refuse_torchscript(model: nn.Module) -> None:
    """A TorchScript module (``torch.jit.script`` / ``torch.jit.trace``) takes no forward hooks
    and its parameters do not copy as leaves: the probe's scan failed with advice to fix the
    example input, and a trial with "can't optimize a non-leaf Tensor", called autoprec's own
    bug (found by a hunt). Refused, naming the module and what works instead."""
    scripted: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") for outer in scripted) or scripted == [""]
        if isinstance(module, torch.jit.ScriptModule) and not inside:
            scripted.append(name)
    if scripted:
        found = (
            "The model is a TorchScript module"
            if scripted == [""]
            else f"The model holds TorchScript modules ({first_names(scripted)})"
        )
        raise TypeError(
            f"{found} (from torch.jit.script or torch.jit.trace): "
            "autoprec hooks, copies and converts Python modules (a mode casts weights, swaps "
            "layers, autocasts the forward), which a TorchScript graph does not allow. Pass "
            "the module before scripting it (torch.compile it instead for compiled speed: "
            "trials then compile too), and script the trained model afterwards."
        )


def refuse_lazy(model: nn.Module) -> None:
    """Refuse a model whose lazy modules have not run yet: their parameters have no shape
    (``nn.LazyLinear``), and a forward would set them on the user's own model."""
    # buffers too: a LazyBatchNorm1d(affine=False) has only lazy buffers, and the probe's
    # forward initialised it on the user's model, its class changed (found by a hunt)
    lazy = [name for name, p in model.named_parameters() if is_lazy(p)]
    lazy += [name for name, b in model.named_buffers() if is_lazy(b)]
    if lazy:
        raise ValueError(
            f"The model has lazy parameters or buffers without a shape yet ({first_names(lazy)}): "
            "run one forward pass on a batch first "
            "(model(example)), as PyTorch asks before building an optimizer."
        )
