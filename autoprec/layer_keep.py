"""The modules a model scan keeps out of low precision by default, and why: in fp32 under pure
bf16, norms and embeddings and modules whose buffers training updates outside the optimizer
(``autoprec.running_state``); out of FP8 (in bf16 autocast), the first and last compute layers
and Linears FP8 kernels cannot take."""

from __future__ import annotations

from torch import nn

from autoprec.layer_kinds import (
    FP8_DIM_MULTIPLE,
    computes_weight,
    fp8_linear_fits,
    is_bnb_4bit,
    is_uncalled_linear,
    module_kind,
    swap_would_drop,
)
from autoprec.layer_mix import KeepFp32

RUNNING_STATE_REASON = "running statistics"
"""How the keep-list names a module whose buffers training updates (pure bf16 keeps it fp32)."""
PURE_BF16_KEEP_REASONS = ("normalisation", "embedding", RUNNING_STATE_REASON)
"""The keep-list reasons pure-bf16 candidates keep in fp32 (the others are FP8's)."""
FP8_SKIP_REASONS = ("first layer", "last layer", "first and last layer", "Linear")
"""The keep-list reasons FP8 candidates keep out of FP8 (in bf16 autocast, not fp32): the
first and last layer and Linears FP8 kernels cannot take. Norms and embeddings need nothing:
bf16 autocast already runs norms in fp32, and a lookup of fp32 weights stays fp32."""


def _running_state_modules(
    model: nn.Module,
    running: tuple[str, ...],
    kept: dict[str, str],
    called: tuple[str, ...] | None = None,
) -> list[KeepFp32]:
    """A keep entry for each module below the root that owns a running buffer and is not kept
    already as a norm or embedding: in bf16 its updates round to nearest, whatever rounding the
    optimizer uses, and an EMA's small ones vanish (``benchmarks/running_state_rounding.py``).
    Not a module whose weights were all loaded in bf16 (a frozen backbone's BatchNorm), as the
    norm rule leaves it: prepare() refuses to keep it, and every pure-bf16 trial failed (found
    by a hunt). Nor one the forward never calls (``called``): an fp32 island converts at its
    own calls, so a bare ``nn.Module()`` holding MoCo's queue, read by its parent, kept the
    queue fp32 beside the parent's bf16 keys, and every pure-bf16 mode failed at step 0 (a
    hunt); its buffers are then judged as state outside the optimizer."""
    owners: dict[str, list[str]] = {}
    for fqn in running:
        owner, _, name = fqn.rpartition(".")
        if owner:
            owners.setdefault(owner, []).append(name)
    entries: list[KeepFp32] = []
    for owner, names in owners.items():
        if kept.get(owner, "").startswith(PURE_BF16_KEEP_REASONS):
            continue
        if loaded_in_low_precision(model.get_submodule(owner)):
            continue
        if called is not None and owner not in called:
            continue
        entries.append(
            KeepFp32(
                fqn=owner,
                reason=f"{RUNNING_STATE_REASON}: training updates its buffers "
                f"({', '.join(names)}) outside the optimizer; in bf16 small updates round away",
            )
        )
    return entries


def loaded_in_low_precision(module: nn.Module) -> bool:
    """Every weight of ``module`` is a floating dtype other than fp32 (a frozen base loaded in
    bf16: trainable weights must be fp32). Keeping it in fp32 has no fp32 values to keep, and
    its fp32 island failed at the first forward ("mixed dtype (CPU): expect parameter to have
    scalar type of Float"): found by a hunt on a LoRA-style model, whose bf16 LayerNorm and
    embedding the probe put on pure bf16's keep list. float64 is no low precision: a frozen
    float64 part (a physics operator) is kept as it is (found by a hunt: it was refused)."""
    weights = [p for p in module.parameters() if p.is_floating_point()]
    return bool(weights) and all(p.dtype.itemsize < 4 for p in weights)


def default_keep_fp32(
    model: nn.Module,
    compute_order: list[str],
    running: tuple[str, ...] = (),
    under_transform: tuple[str, ...] = (),
    *,
    raw_matmuls: tuple[str, ...] = (),
    raw_at_end: tuple[str, ...] = (),
    called: tuple[str, ...] | None = None,
) -> tuple[KeepFp32, ...]:
    """What pure bf16 keeps in fp32 and FP8 keeps out of FP8, with why. ``raw_matmuls``: the
    parameters the forward multiplies raw (:class:`LayerMix`); an embedding whose weight is
    among them (a head tied by ``F.linear(x, self.embed.weight)``) is not kept: its fp32
    weight met bf16 activations in that matmul, and every pure-bf16 mode failed at step 0
    (found by a hunt). ``raw_at_end``: the raw parameters of the forward's last matmul; where
    one is an embedding's (that tied head), the last module called is an inner layer, not the
    one producing the outputs (a raw matmul after a classifier's head, a learned transition
    matrix, leaves the head the last layer: a review). ``called``: the modules the forward
    called (None: not known); a module owning a running buffer that is never called is not
    kept (:func:`_running_state_modules`)."""
    keep: dict[str, str] = {}
    tied_head = any(
        f"{fqn}.weight".removeprefix(".") in raw_at_end
        for fqn, module in model.named_modules()
        if module_kind(module) == "embedding"
    )
    compute_layers = compute_order or [
        fqn for fqn, module in model.named_modules() if module_kind(module) in ("linear", "conv")
    ]
    matmul_layers = [
        fqn for fqn in compute_layers if module_kind(model.get_submodule(fqn)) != "embedding"
    ]
    for fqn, module in model.named_modules():
        kind = module_kind(module)
        if loaded_in_low_precision(module):
            continue  # a frozen base loaded in bf16 (LoRA): no fp32 weights to keep
        if kind == "norm":
            keep[fqn] = "normalisation: statistics need full precision"
        elif kind == "embedding" and not any(
            f"{fqn}.{name}".removeprefix(".") in raw_matmuls
            for name, _ in module.named_parameters()
        ):
            # frozen ones too, though a plain frozen lookup would train alike in bf16 (a LoRA
            # base's vocabulary, 2 bytes a parameter): a frozen table the forward changes (an
            # EMA codebook, max_norm's in-place renorm) is state outside the optimizer, and
            # an EmbeddingBag sums rows rounded first (found by a review of that change)
            keep[fqn] = "embedding: a lookup, nothing for low precision to speed up"
    if matmul_layers and tied_head:  # the last one called is inner: not "last layer"
        keep.setdefault(matmul_layers[0], "first layer: sees raw inputs")
    elif len(matmul_layers) == 1:
        keep.setdefault(
            matmul_layers[0],
            "first and last layer: sees raw inputs and produces the outputs the loss sees",
        )
    elif matmul_layers:
        keep.setdefault(matmul_layers[0], "first layer: sees raw inputs")
        keep.setdefault(matmul_layers[-1], "last layer: produces the outputs the loss sees")
    for fqn in under_transform:
        keep.setdefault(
            fqn,
            "Linear called under torch.vmap or another torch.func transform: FP8 module "
            "swaps cannot run there (their autograd function has no rule for it)",
        )
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and computes_weight(module):
            keep.setdefault(
                fqn,
                "Linear with a computed weight (weight_norm, spectral_norm or another "
                "parametrization): FP8 module swaps cannot take it",
            )
        elif (
            isinstance(module, nn.Linear)
            and not is_uncalled_linear(module)
            and (dropped := swap_would_drop(module)) is not None
        ):
            keep.setdefault(
                fqn, f"an FP8 module swap would drop what this Linear has of its own: {dropped}"
            )
        elif (
            isinstance(module, nn.Linear)
            and not is_uncalled_linear(module)
            and not is_bnb_4bit(module)
            and not fp8_linear_fits(module)
        ):
            keep.setdefault(
                fqn,
                f"Linear {module.in_features}x{module.out_features}: dimensions not divisible "
                f"by {FP8_DIM_MULTIPLE}, FP8 kernels cannot take it",
            )
    entries = [KeepFp32(fqn=fqn, reason=reason) for fqn, reason in keep.items()]
    return tuple(entries + _running_state_modules(model, running, keep, called))
