"""CPU facts: its model name, usable cores and memory, whether bf16 and fp16 autocast run on it
forward and backward (a tiny matmul tells; PyTorch's CPU fp16 kernels are slow but run), and
whether its instruction set computes in bf16 (without, PyTorch's bf16 kernels run, slowly)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD


class AutocastCheck(BaseModel):
    """Result of a tiny autocast matmul (forward and backward) on the CPU."""

    model_config = FROZEN_RECORD

    dtype: Literal["bfloat16", "float16"]
    works: bool
    error: str | None = None


class CpuInfo(BaseModel):
    model_config = FROZEN_RECORD

    model_name: str
    logical_cores: int
    usable_cores: int
    memory_total_bytes: int | None
    autocast: tuple[AutocastCheck, ...]
    native_bf16: bool | None = None
    """Whether the instruction set has bf16 arithmetic (``NATIVE_BF16_FLAGS`` among the CPU's
    flags; on macOS ``hw.optional.arm.FEAT_BF16``); None where neither can be read. Without
    it, bf16 runs far slower than fp32: on a 2-core AMD EPYC without avx512_bf16, amp_bf16's
    step took 13.7x fp32's on tiny_gpt and 17x on small_convnet (`make demo`,
    examples/README), where the same CPUs with it ran amp_bf16 1.2x and 1.8x faster than
    fp32."""

    def autocast_works(self, dtype: Literal["bfloat16", "float16"]) -> bool:
        return any(check.dtype == dtype and check.works for check in self.autocast)


def check_cpu_autocast(dtype: Literal["bfloat16", "float16"]) -> AutocastCheck:
    """Run a tiny autocast matmul forward and backward on the CPU in ``dtype``."""
    torch_dtype = getattr(torch, dtype)
    try:
        # the caller's no_grad / default dtype / default device (meta, to build a big model)
        # made the check fail and every autocast mode read as impossible (found by a hunt)
        with torch.inference_mode(False), torch.enable_grad():
            weight = torch.ones(8, 8, dtype=torch.float32, device="cpu", requires_grad=True)
            with torch.autocast("cpu", dtype=torch_dtype):
                out = torch.ones(4, 8, dtype=torch.float32, device="cpu") @ weight
            if out.dtype == torch_dtype:
                out.float().sum().backward()
        if out.dtype != torch_dtype:
            return AutocastCheck(
                dtype=dtype, works=False, error=f"autocast produced {out.dtype}, not {torch_dtype}"
            )
        if weight.grad is None or not bool(torch.isfinite(weight.grad).all()):
            return AutocastCheck(dtype=dtype, works=False, error="backward gave no finite gradient")
    except Exception as error:  # noqa: BLE001 - whatever fails, the dtype does not work here
        return AutocastCheck(dtype=dtype, works=False, error=f"{type(error).__name__}: {error}")
    return AutocastCheck(dtype=dtype, works=True)


_PROC_CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""x86's AVX-512 BF16 and AMX-BF16 (Linux /proc/cpuinfo "flags"), Arm's BF16 ("Features")."""


def _native_bf16(cpuinfo: str) -> bool | None:
    """Whether /proc/cpuinfo's text lists a bf16 instruction-set flag; None without flags."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & NATIVE_BF16_FLAGS) if flags else None


ARM_CORES = {
    "0xd0c": "Neoverse-N1",
    "0xd40": "Neoverse-V1",
    "0xd49": "Neoverse-N2",
    "0xd4f": "Neoverse-V2",
    "0xd8e": "Neoverse-N3",
    "0xd84": "Neoverse-V3",
}
"""Arm's own cores by /proc/cpuinfo "CPU part" (implementer 0x41), as the Linux kernel's
cputype.h names them: Graviton2 is an N1 (no bf16), Graviton3 a V1 and Grace a V2 (bf16)."""


def _cpu_model_name(cpuinfo: str) -> str:
    """The CPU's name: x86's "model name"; on Arm Linux, which prints none, its core from
    "CPU implementer" and "CPU part" (it was recorded as "aarch64" on every Arm machine, so a
    profile proven on a CPU with bf16 instructions applied without a word on one without:
    found by a hunt); on macOS the brand string ("Apple M2"), not "arm"."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Model", "Hardware"):
        if fields.get(key):
            return fields[key]
    implementer, part = fields.get("CPU implementer"), fields.get("CPU part")
    if implementer and part:
        core = ARM_CORES.get(part) if implementer == "0x41" else None
        found = f"CPU implementer {implementer}, part {part}"
        return f"Arm {core} ({found})" if core else f"{platform.machine()} ({found})"
    return _darwin_sysctl("machdep.cpu.brand_string") or (
        platform.processor() or platform.machine() or "unknown CPU"
    )


def _darwin_sysctl(name: str) -> str | None:
    """A macOS sysctl value, or None elsewhere or when it cannot be read."""
    if sys.platform != "darwin":
        return None
    try:
        found = subprocess.run(
            ["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def _darwin_native_bf16() -> bool | None:
    """Whether an Apple CPU has Arm's BF16 instructions (M2 and later), None off macOS."""
    value = _darwin_sysctl("hw.optional.arm.FEAT_BF16")
    return None if value is None else value == "1"


def _memory_total() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def read_cpu(*, check_autocast: bool = True) -> CpuInfo:
    logical = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    checks = (
        (check_cpu_autocast("bfloat16"), check_cpu_autocast("float16")) if check_autocast else ()
    )
    cpuinfo = _PROC_CPUINFO.read_text(errors="replace") if _PROC_CPUINFO.exists() else ""
    return CpuInfo(
        model_name=_cpu_model_name(cpuinfo),
        logical_cores=logical,
        usable_cores=usable,
        memory_total_bytes=_memory_total(),
        autocast=checks,
        native_bf16=_native_bf16(cpuinfo) if cpuinfo else _darwin_native_bf16(),
    )
