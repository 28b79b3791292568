"""What a failed trial's exception was: out of memory, a compiler error, a mode that cannot run,
or anything else, as a :class:`TrialFailure` with a one-line message."""

from __future__ import annotations

import re
import sysconfig
import traceback
from pathlib import Path

import torch

from autoprec.errors import AutoprecError, UnsupportedModeError
from autoprec.model_copies import CompileSetupError
from autoprec.trial_records import FailureKind, TrialFailure


class EvalFnError(Exception):
    """The user's ``eval_fn`` raised on a trained copy (the message names its error)."""


class StopCheckRaised(Exception):
    """The trial's stop check raised ``error``: the caller's own code (a progress callback,
    ``tune(on_event=...)``) failed, not the trial. The trial re-raises ``error`` as it is,
    never records it as the mode's failure."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def is_oom(error: BaseException) -> bool:
    """Out of memory: CUDA's allocator, the host's, or a RuntimeError that says so."""
    if isinstance(error, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _is_compile_error(error: BaseException) -> bool:
    """An error raised by torch.compile's tracer (dynamo) or compiler (inductor), or by the
    ``torch.compile`` call itself."""
    if isinstance(error, CompileSetupError):
        return True
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


_FP8_SHAPE_ERRORS = re.compile(
    r"divisible by 16|dim_for_fp8_exec|must be divisible by (8|16)|multiple of (8|16)"
)
"""FP8 GEMMs' shape checks: torch._scaled_mm's ("Expected trailing dimension of mat1 to be
divisible by 16": in torchao's backward the tokens of a batch are the inner dimension) and
Transformer Engine's (``assert_dim_for_fp8_exec``: tokens divisible by 8)."""
FP8_SHAPE_HINT = (
    " (FP8 matmuls need the tokens of a batch, every dimension of a Linear's input but the "
    "last, divisible by 16: pad sequences or batches to a multiple of 16, drop a ragged last "
    "batch (DataLoader(drop_last=True)), or pass FP8 over)"
)

_LOW_PRECISION_KERNEL_ERRORS = re.compile(
    r"Unsupported dtype (BFloat16|Half)|not implemented for '(BFloat16|Half)'"
    r"|MKL FFT doesn't support tensors of type: (BFloat16|Half)|Low precision dtypes not supported"
)
"""torch's errors for an op that has no kernel for bf16 or fp16 tensors on this device:
``torch.fft.rfft`` on bf16 on our CPUs ("Unsupported dtype BFloat16"), ``torch.stft`` ("MKL
FFT doesn't support tensors of type: BFloat16"), ``torch.linalg.inv`` ("Low precision dtypes
not supported"; these two found by a review), and kernels dispatched by dtype
("\"addmm_impl_cpu_\" not implemented for 'Half'")."""
LOW_PRECISION_KERNEL_HINT = (
    " (an op in your model has no kernel for the low-precision tensors this mode hands it: "
    "keep the module that calls it in fp32 (keep_fp32=['name'], --keep-fp32 name), or cast "
    "around the op (op(x.float()).to(x.dtype)))"
)

LOW_PRECISION_LOSS_HINT = (
    " (an op of your loss_fn or train_step, outside the model's modules, has no kernel for the "
    "low-precision tensors this mode hands it: cast its input to fp32 there "
    "(F.ctc_loss(log_probs.float(), ...)); keep_fp32 cannot reach it)"
)


def _raised_outside_the_model(error: Exception, model: torch.nn.Module | None) -> bool:
    """Did ``error`` rise with no module of ``model`` called on the stack (without a model: no
    module but a loss module): in a ``loss_fn`` or ``train_step`` (``F.ctc_loss`` on a bf16
    model's log-probabilities, a loss written as a module, a frozen perceptual network it
    calls), where keeping a module in fp32 cannot help (found by a hunt: it was advised, and
    failed the same; a review, the loss module). False without a traceback."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    calls = [
        frame.f_locals.get("self")
        for frame in frames
        if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl")
        and frame.f_code.co_filename.endswith("module.py")
    ]
    if model is None:
        return bool(frames) and all(isinstance(m, torch.nn.modules.loss._Loss) for m in calls)
    ours = {id(module) for module in model.modules()}
    return bool(frames) and not any(id(module) in ours for module in calls)


_HOOK_CHANGED_DTYPE = re.compile(r"hook '[^']*' has changed the type of value")
"""torch's error when a tensor hook on a parameter returns a gradient of another dtype: a
pruning mask's ``g * mask`` with an fp32 mask on pure bf16's bf16 gradients (a hunt)."""
HOOK_DTYPE_HINT = (
    " (a gradient hook on a parameter (register_hook) returned another dtype than the "
    "gradient's: under pure bf16 the gradients are bf16; return it in the gradient's dtype, "
    "g * mask.to(g.dtype))"
)


_MIXED_DTYPES = re.compile(
    r"m1 and m2 to have the same dtype|must have the same dtype"
    r"|expected scalar type \w+ but found \w+|(Input|bias) type \(.*\) should be"
    r"|to have the same dtype|to have same dtype|dtypes match|dtypes must be the same"
    r"|same scalar type|expected self and source to have same dtypes"
    r"|input dtype .* does not match weight dtype|mixed dtype \(CPU\)"
)
"""torch's errors when an op meets tensors of two dtypes: a custom autograd Function or
custom op whose fp32 output or saved tensor meets the mode's bf16 ones (a hunt: torch's bare
words, with no advice); matmuls (addmm's "self and mat2", a bias), convolutions, attention,
index_put, index_add, masked_scatter, dot, baddbmm, RNNs and CPU norms each say it their way
(scatter's names no dtype, and gets no hint). Hinted only where the message names bf16 or fp16
(``_LOW_PRECISION_NAMED``): a loader's int64 features meeting fp32 weights is the user's
input, and an fp32 CPU tensor beside a CUDA weight the device's (a review)."""
_LOW_PRECISION_NAMED = re.compile(r"BFloat16|bfloat16|Half|float16|mixed dtype \(CPU\)")
"""(CPU norms' "mixed dtype" error is only ever about bf16 or fp16 input.)"""
MIXED_DTYPES_HINT = (
    " (two tensors of different dtypes met in one op: something your code makes or keeps in "
    "fp32 (a buffer, torch.zeros without a dtype, a custom autograd Function's output or "
    "saved tensor) met the mode's bf16 or fp16 ones. Cast it where it is made "
    "(.to(x.dtype)), keep the module that reads it in fp32 (keep_fp32), or under AMP wrap a "
    "custom Function in torch.amp.custom_fwd / custom_bwd)"
)


_FP8_MIXED_MATMUL = re.compile(r"Expecting\s+both Float8TrainingTensor for mm inputs")
"""torchao's assertion when a matmul of a Float8Linear meets a plain tensor: a second
derivative through it (autograd.grad with create_graph=True: a gradient penalty, a
physics-informed loss) does this (found by a hunt: it was the whole reason given)."""
FP8_TWICE_HINT = (
    " (torchao's FP8 Linears cannot be differentiated twice: a gradient penalty or a "
    "physics-informed loss (autograd.grad with create_graph=True) differentiates through them "
    "again. Keep the Linears it passes through out of FP8 (keep_fp32=['name'], --keep-fp32 "
    "name), or leave FP8 out)"
)


def failure_of(
    error: Exception, step: int | None, model: torch.nn.Module | None = None
) -> TrialFailure:
    """The failure ``error`` raised at ``step`` (None: before training) records; ``model``:
    the trained copy (what its hints may name)."""
    if isinstance(error, UnsupportedModeError):
        return TrialFailure(
            kind="unsupported", step=None, message="; ".join(error.reasons) or str(error)
        )
    if isinstance(error, EvalFnError):
        return TrialFailure(kind="eval_failed", step=None, message=str(error))
    kind: FailureKind = "out_of_memory" if is_oom(error) else "exception"
    message = f"{type(error).__name__}: {first_line(error)}"
    if kind == "exception" and _is_compile_error(error):
        kind = "compile_failed"
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is not None:  # the compiler's own error says what failed
            message += f" {type(inner).__name__}: {first_line(inner)}"
        message = f"torch.compile failed: {message} (run this mode eager: compile=False)"
    if _FP8_SHAPE_ERRORS.search(message):
        message += FP8_SHAPE_HINT
    elif _LOW_PRECISION_KERNEL_ERRORS.search(message):
        outside = _raised_outside_the_model(error, model)
        message += LOW_PRECISION_LOSS_HINT if outside else LOW_PRECISION_KERNEL_HINT
    elif _FP8_MIXED_MATMUL.search(message):
        message += FP8_TWICE_HINT
    elif _HOOK_CHANGED_DTYPE.search(message):
        message += HOOK_DTYPE_HINT
    elif _MIXED_DTYPES.search(message) and _LOW_PRECISION_NAMED.search(message):
        message += MIXED_DTYPES_HINT
    frames = traceback.extract_tb(error.__traceback__)
    return TrialFailure(
        kind=kind,
        step=step,
        message=message,
        raised_in=raised_in(frames),
        # autoprec's own refusals of your input (a loss that is not one number) are yours
        raised_by_autoprec=bool(frames)
        and _own(Path(frames[-1].filename).resolve())
        and not isinstance(error, AutoprecError),
    )


_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
"""The directory autoprec's package sits in: frames under ``autoprec/`` there are its own."""
_LIBRARY_ROOTS = tuple(
    Path(path).resolve()
    for path in {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
)


def _own(file: Path) -> bool:
    return file.is_relative_to(_PACKAGE_ROOT / "autoprec")


def raised_in(frames: traceback.StackSummary) -> str | None:
    """``path:line in function`` of the innermost of ``frames`` (a traceback's) that is
    autoprec's own (``autoprec/...``) or outside every installed library and the standard
    library (the user's model, loss or loader; relative to the working directory when under
    it): where to look, which torch's innermost frames seldom say. None when every frame is a
    library's."""
    for frame in reversed(frames):
        file = Path(frame.filename).resolve()
        if _own(file):
            name = file.relative_to(_PACKAGE_ROOT).as_posix()
        elif any(file.is_relative_to(root) for root in _LIBRARY_ROOTS) or not file.exists():
            continue
        elif file.is_relative_to(Path.cwd()):
            name = file.relative_to(Path.cwd()).as_posix()
        else:
            name = str(file)
        return f"{name}:{frame.lineno} in {frame.name}"
    return None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
