"""What a model scan found, as data: parameters and FLOPs by layer kind, each Linear's FP8
fit, the modules kept in fp32 and why (``autoprec.layers.scan_model`` builds it)."""

from __future__ import annotations

from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.layer_kinds import LayerKind


class KindShare(BaseModel):
    """Parameters and forward FLOPs of one layer kind."""

    model_config = FROZEN_RECORD

    kind: LayerKind
    parameters: int
    parameter_share: float
    flops: int | None
    flop_share: float | None


class LinearInfo(BaseModel):
    """One nn.Linear (or HF Conv1D) and its fit for FP8."""

    model_config = FROZEN_RECORD

    fqn: str
    in_features: int
    out_features: int
    flops: int | None
    fp8_compatible: bool
    """An nn.Linear with both dimensions divisible by 16 (what FP8 kernels take and FP8 module
    swaps convert)."""
    bnb_4bit: bool = False
    """A bitsandbytes 4-bit Linear (QLoRA's quantized base): FP8 conversions leave it as it
    is (not compatible), and it is not kept in fp32 for its dimensions."""
    hf_conv1d: bool = False
    """A Hugging Face Conv1D: counted as a Linear, but torchao's and Transformer Engine's FP8
    conversions replace nn.Linear modules only, so it stays out of FP8 (not compatible)."""
    computed_weight: bool = False
    """Its weight is computed (weight_norm, spectral_norm, a parametrization): an FP8 swap
    cannot take it (not compatible)."""
    swap_drops: bool = False
    """An FP8 swap would drop part of it: a subclass's own forward or methods, tensors beside
    weight and bias, public attributes, or hooks (not compatible;
    ``layer_kinds.swap_would_drop``)."""
    under_transform: bool = False
    """The scan's forward called it under ``torch.vmap`` or another ``torch.func`` transform
    (an ensemble, a per-element network): an FP8 swap's autograd function has no rule for
    them ("it must override the setup_context staticmethod") and the trial failed at its
    first step (found by a hunt). Not compatible."""
    already_fp8: bool = False
    """Already an FP8 module (torchao's Float8Linear, converted before autoprec saw it)."""
    fp8_worthwhile: bool
    """Compatible and big enough that FP8 is likely to gain (torchao's auto-filter rule)."""


class KeepFp32(BaseModel):
    """A module kept in full precision by default, and why."""

    model_config = FROZEN_RECORD

    fqn: str
    reason: str


class LayerMix(BaseModel):
    """What a model is made of, as far as precision choices care."""

    model_config = FROZEN_RECORD

    model_class: str
    parameters: int
    trainable_parameters: int
    parameters_in_large_tensors: int
    """Trainable parameters in tensors of >= 4096 elements (those bitsandbytes keeps in 8 bit;
    a frozen weight has no optimizer state to save: a LoRA's base counted as 6 MiB saved where
    nothing was, found by a hunt)."""
    by_kind: tuple[KindShare, ...]
    forward_flops: int | None
    """FLOPs of one forward pass on the example input (matmul, conv, attention); None if not run."""
    forward_error: str | None = None
    linears: tuple[LinearInfo, ...]
    fp8_eligible_flop_share: float | None
    """Share of forward FLOPs in FP8-compatible Linears; None when no forward pass ran."""
    raw_param_matmuls: tuple[str, ...]
    """Names of parameters used directly in matmuls (outside Linear/Conv modules)."""
    keep_fp32: tuple[KeepFp32, ...]
    """Modules kept out of low precision by default: the reasons in
    ``layer_keep.PURE_BF16_KEEP_REASONS`` are kept in fp32 under pure bf16, those in
    ``layer_keep.FP8_SKIP_REASONS`` out of FP8 (in bf16 autocast)."""
    findings: tuple[str, ...]
    complex_parameters: tuple[str, ...] = ()
    """Names of trainable complex parameters (a Fourier layer's spectral weights)."""
    sparse_gradient_modules: tuple[str, ...] = ()
    """Names of trainable ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` (their
    weights get sparse gradients)."""
    lstm_modules: tuple[str, ...] = ()
    """Names of ``nn.LSTM`` modules without ``proj_size``: oneDNN has no fp16 LSTM, so amp_fp16
    fails on a CPU ("could not create a primitive descriptor for the LSTM forward"; GRU, RNN
    and an LSTM with ``proj_size``, which torch runs without oneDNN, run)."""
    running_buffers: tuple[str, ...] = ()
    """Floating buffers a training-mode forward changes (BatchNorm statistics, a running
    normaliser, an EMA codebook): state outside the optimizer (``autoprec.running_state``)."""
    running_buffers_error: str | None = None
    """Why the training-mode forward that finds ``running_buffers`` failed, if it did."""
    weights_not_fp32: str | None = None
    """What is not fp32 among the trainable parameters, in words (``weight_dtypes.
    non_fp32_weights``); None when all are fp32. tune, check and apply refuse such a model."""
    forward_autocast: str | None = None
    """The autocast the model's forward enters itself (``"bfloat16 autocast on cpu at
    blocks.0.attn"``: the module whose torch call first ran under it,
    ``autoprec.own_autocast``); None: none, or no forward ran. It sets the dtype of every run,
    the fp32 reference's too: tune and check refuse such a model."""

    def kept_for(self, reasons: str | tuple[str, ...]) -> tuple[str, ...]:
        """The modules of ``keep_fp32`` kept for a reason starting with ``reasons``, once each."""
        return tuple(dict.fromkeys(k.fqn for k in self.keep_fp32 if k.reason.startswith(reasons)))

    def kind(self, kind: LayerKind) -> KindShare:
        """The share of one layer kind; none in a scan saved before the kind existed (such a
        scan counted nn.LSTM/GRU/RNN layers as ``raw_param``)."""
        found = next((share for share in self.by_kind if share.kind == kind), None)
        if found is not None:
            return found
        flops = None if self.forward_flops is None else 0
        return KindShare(
            kind=kind,
            parameters=0,
            parameter_share=0.0,
            flops=flops,
            flop_share=None if flops is None else 0.0,
        )

    @property
    def fp8_compatible_linears(self) -> tuple[LinearInfo, ...]:
        return tuple(linear for linear in self.linears if linear.fp8_compatible)
