"""8-bit optimizer moments kept the way bitsandbytes' 8-bit optimizers keep them.

Used by the stochastic-rounding optimizers with ``state_bits=8`` (``bf16_sr+8bit-optim``):
a moment of ``MIN_8BIT_SIZE`` elements or more is stored as one uint8 code per element on
bitsandbytes' dynamic map (signed for Adam's first moment and SGD's momentum, unsigned for the
second moment) and one fp32 absmax per block of ``BLOCK_SIZE`` elements; a smaller one stays
fp32. The block size, the maps and the size floor are those of bitsandbytes 0.50's
``Optimizer2State``/``Optimizer1State`` with ``optim_bits=8`` (its ``min_8bit_size`` default),
so the moments lose what ``AdamW8bit``'s lose. Quantisation rounds to nearest, as its kernels do:
a second moment at β2 0.999 still decays, because each block's absmax decays with it
(``tests/test_drift.py::test_an_8bit_second_moment_decays_where_a_bf16_one_cannot``).
"""

from __future__ import annotations

import torch

from autoprec._imports import require

BLOCK_SIZE = 256
"""Elements per absmax block (bitsandbytes' blockwise 8-bit optimizers)."""

MIN_8BIT_SIZE = 4096
"""Smaller moments stay fp32 (bitsandbytes' ``min_8bit_size`` default)."""

SIGNED_MOMENTS = {"exp_avg": True, "exp_avg_sq": False, "momentum_buffer": True}
"""The moments the stochastic-rounding optimizers keep, and whether each can be negative."""


def codes_key(key: str) -> str:
    return f"{key}_codes"


def absmax_key(key: str) -> str:
    return f"{key}_absmax"


class EightBitStates:
    """Quantise fp32 moments to 8-bit codes and back (bitsandbytes' block-wise functions)."""

    def __init__(self) -> None:
        self._functional = require("bitsandbytes").functional
        self._maps: dict[tuple[bool, torch.device], torch.Tensor] = {}

    def _map(self, signed: bool, device: torch.device) -> torch.Tensor:
        key = (signed, device)
        if key not in self._maps:
            self._maps[key] = self._functional.create_dynamic_map(signed=signed).to(device)
        return self._maps[key]

    def quantize(self, value: torch.Tensor, *, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 codes shaped as ``value``, fp32 absmax per block) of an fp32 tensor."""
        code = self._map(signed, value.device)
        codes, quant_state = self._functional.quantize_blockwise(
            value.float().contiguous(), code=code, blocksize=BLOCK_SIZE
        )
        return codes, quant_state.absmax

    def dequantize(
        self, codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool
    ) -> torch.Tensor:
        """The fp32 tensor the codes stand for (a new tensor)."""
        code = self._map(signed, codes.device)
        value = self._functional.dequantize_blockwise(
            codes, absmax=absmax, code=code, blocksize=BLOCK_SIZE
        )
        return value.float()

    def encode(self, value: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
        """The codes of ``value`` on given block scales: a checkpoint's dequantised moment with
        its saved absmax gives back the codes it was saved from (quantising it afresh
        rescales a block whose largest value is negative: the signed map ends at -0.993)."""
        code = self._map(signed, value.device)
        flat = value.float().reshape(-1)
        pad = (-flat.numel()) % BLOCK_SIZE
        padded = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, BLOCK_SIZE)
        scale = absmax.float().reshape(-1, 1)
        normalized = torch.where(scale > 0, padded / scale.clamp_min(1e-38), 0.0).reshape(-1)
        upper = torch.bucketize(normalized, code).clamp(1, code.numel() - 1)
        lower = upper - 1
        nearer_upper = (code[upper] - normalized).abs() < (normalized - code[lower]).abs()
        codes = torch.where(nearer_upper, upper, lower)[: flat.numel()]
        return codes.to(torch.uint8).reshape(value.shape)

    def fresh(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero codes and absmax for a moment of ``like``'s shape."""
        codes = torch.zeros(like.shape, dtype=torch.uint8, device=like.device)
        absmax = torch.zeros(blocks(like), dtype=torch.float32, device=like.device)
        return codes, absmax


def blocks(tensor: torch.Tensor) -> int:
    """The absmax blocks of a moment shaped as ``tensor``."""
    return -(-tensor.numel() // BLOCK_SIZE)


def keeps_8bit(parameter: torch.Tensor) -> bool:
    """Whether a moment of this parameter is stored 8-bit (else fp32)."""
    return parameter.numel() >= MIN_8BIT_SIZE
