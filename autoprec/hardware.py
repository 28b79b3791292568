"""Hardware facts: GPUs (NVML, else torch), the CPU (cpu_info), and what each can compute in.

NVML missing or failing (no driver, no GPU, a container without the library) is normal and
recorded as a status line, never raised. Readers take the ``pynvml`` module and ``torch.cuda``
as arguments so tests inject any device (V100 ... B200) without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import warnings
from types import ModuleType
from typing import Any, Literal

import torch
from pydantic import BaseModel

from autoprec._models import FROZEN_RECORD
from autoprec.cpu_info import CpuInfo, read_cpu

FormatName = Literal["fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8", "mxfp8", "fp4"]

FORMAT_MIN_CAPABILITY: dict[FormatName, tuple[int, int]] = {
    "fp16_tensor_cores": (7, 0),  # Volta
    "bf16": (8, 0),  # Ampere
    "tf32": (8, 0),  # Ampere
    "sparse_2_4": (8, 0),  # Ampere sparse tensor cores
    "fp8": (8, 9),  # Ada (8.9), Hopper (9.0)
    "mxfp8": (10, 0),  # Blackwell
    "fp4": (10, 0),  # Blackwell
}
"""Minimum CUDA compute capability of each number format on tensor cores."""

ROCM_FORMATS: tuple[FormatName, ...] = ("fp16_tensor_cores", "bf16")
"""What autoprec claims for an AMD GPU under a ROCm build of torch: fp16 and bf16 autocast.
torch reports a ROCm GPU's gfx name as a "capability" (gfx90a, an MI250X without FP8: 9.0;
gfx1100: 11.0), which NVIDIA's table above would read as FP8 and FP4 hardware; torch's own FP8
check on ROCm goes by the gfx name (gfx94x, gfx95x, gfx120x). TF32 and FP8 modes are refused
there with that reason until they are written and tested for AMD GPUs."""


class FormatSupport(BaseModel):
    """Whether one number format runs on tensor cores of a GPU."""

    model_config = FROZEN_RECORD

    format: FormatName
    supported: bool
    reason: str


class GpuInfo(BaseModel):
    """One CUDA device."""

    model_config = FROZEN_RECORD

    index: int
    name: str
    capability: tuple[int, int]
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    driver_version: str | None
    uuid: str | None
    source: Literal["nvml", "torch"]
    """Where the facts came from: NVML when it works, else torch."""
    usable_by_torch: bool
    """False when NVML sees the GPU but this torch build or process cannot use it."""
    rocm_arch: str | None = None
    """An AMD GPU under a ROCm build of torch: its gfx architecture (``gcnArchName``). Its
    ``capability`` is then torch's reading of that name (gfx90a: 9.0), not an NVIDIA compute
    capability, and only fp16 and bf16 are claimed for it (``ROCM_FORMATS``)."""
    mig_enabled: bool = False
    """NVML reports the GPU in MIG mode: CUDA then shows only its MIG instances, none when
    none was created."""

    @property
    def capability_str(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    @property
    def label(self) -> str:
        if self.rocm_arch is not None:
            return f"{self.name}, ROCm {self.rocm_arch}"
        return f"{self.name}, {self.capability_str}"

    def formats(self) -> tuple[FormatSupport, ...]:
        if self.rocm_arch is None:
            return capability_formats(self.capability, self.name)
        return tuple(
            FormatSupport(
                format=format_name,
                supported=format_name in ROCM_FORMATS,
                reason=f"ROCm build, {self.label}: "
                + (
                    "autocast runs there"
                    if format_name in ROCM_FORMATS
                    else "autoprec's rule for it follows NVIDIA compute capabilities, not "
                    "written for AMD GPUs"
                ),
            )
            for format_name in FORMAT_MIN_CAPABILITY
        )

    def supports(self, format_name: FormatName) -> bool:
        if self.rocm_arch is not None:
            return format_name in ROCM_FORMATS
        return self.capability >= FORMAT_MIN_CAPABILITY[format_name]


class HardwareInfo(BaseModel):
    """Everything autoprec needs to know about the machine."""

    model_config = FROZEN_RECORD

    torch_version: str
    torch_cuda_runtime: str | None
    """CUDA runtime torch was built with (torch.version.cuda); None for CPU and ROCm builds."""
    torch_hip_runtime: str | None = None
    """HIP runtime of a ROCm build of torch (torch.version.hip); None otherwise."""
    cuda_available: bool
    nvml_status: str
    """"ok" or why NVML could not be used."""
    driver_version: str | None
    gpus: tuple[GpuInfo, ...]
    cpu: CpuInfo
    platform: str
    python_version: str
    warnings: tuple[str, ...] = ()

    def gpu(self, index: int) -> GpuInfo:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise ValueError(f"No CUDA device {index}; {self.describe_gpus()}.")

    def describe_gpus(self) -> str:
        usable = [gpu for gpu in self.gpus if gpu.usable_by_torch]
        if not usable:
            return f"this machine has no CUDA device usable by torch {self.torch_version}"
        listed = ", ".join(f"cuda:{gpu.index}: {gpu.name}" for gpu in usable)
        return f"this machine has {len(usable)} CUDA device(s) ({listed})"

    def resolve_device(self, device: str | int | None) -> str:
        """Normalise a device choice to ``"cpu"`` or ``"cuda:N"``, checking that it exists.

        None picks ``cuda:0`` when torch can use a GPU, else ``cpu``.
        """
        if device is None:
            return "cuda:0" if any(gpu.usable_by_torch for gpu in self.gpus) else "cpu"
        text = str(device).strip().lower()
        if text in ("cpu", "cpu:0"):  # torch names the one CPU device either way
            return "cpu"
        if text == "cuda":
            text = "cuda:0"
        index_text = text.removeprefix("cuda:")
        if not index_text.isdigit():
            raise ValueError(
                f"device must be 'cpu', 'cuda', 'cuda:N' or a GPU index, but got {device!r}."
            )
        index = int(index_text)
        if not any(gpu.index == index and gpu.usable_by_torch for gpu in self.gpus):
            raise ValueError(f"Device {device!r} is not available: {self.describe_gpus()}.")
        return f"cuda:{index}"


def capability_formats(capability: tuple[int, int], name: str = "GPU") -> tuple[FormatSupport, ...]:
    """Which number formats a GPU of this compute capability runs on tensor cores, with reasons."""
    found = f"{name}, {capability[0]}.{capability[1]}"
    return tuple(
        FormatSupport(
            format=format_name,
            supported=capability >= minimum,
            reason=f"compute capability >= {minimum[0]}.{minimum[1]} (found: {found})",
        )
        for format_name, minimum in FORMAT_MIN_CAPABILITY.items()
    )


# -- NVML ------------------------------------------------------------------------------------


def load_pynvml() -> tuple[ModuleType | None, str]:
    """Import pynvml (from nvidia-ml-py) quietly; returns (module or None, status)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecated `pynvml` shim warns on import
            import pynvml
    except Exception as error:  # noqa: BLE001 - any failure means "no NVML"
        return None, f"pynvml not importable ({type(error).__name__}); install nvidia-ml-py"
    return pynvml, "ok"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def read_nvml(pynvml: ModuleType) -> tuple[list[GpuInfo], str | None, str]:
    """Read every GPU NVML sees. Returns (gpus, driver version, status); never raises."""
    try:
        pynvml.nvmlInit()
    except Exception as error:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], None, f"NVML unavailable ({_nvml_error(error)})"
    try:
        gpus: list[GpuInfo] = []
        problems: list[str] = []
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except Exception as error:  # noqa: BLE001 - said in the status (found by a hunt)
            driver = None
            problems.append(f"driver version: {_nvml_error(error)}")
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                gpus.append(_read_nvml_device(pynvml, index, driver))
            except Exception as error:  # noqa: BLE001 - one broken GPU must not hide the others
                problems.append(f"GPU {index}: {_nvml_error(error)}")
        status = "ok" if not problems else "partial (" + "; ".join(problems) + ")"
        return gpus, driver, status
    except Exception as error:  # noqa: BLE001
        return [], None, f"NVML failed ({_nvml_error(error)})"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _read_nvml_device(pynvml: ModuleType, index: int, driver: str | None) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        total, free = int(memory.total), int(memory.free)
    except Exception:  # noqa: BLE001 - NotSupported on some MIG and virtual GPUs
        total, free = None, None
    try:
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    except Exception:  # noqa: BLE001
        uuid = None
    try:
        mig_enabled = bool(pynvml.nvmlDeviceGetMigMode(handle)[0])  # (current, pending)
    except Exception:  # noqa: BLE001 - NotSupported on GPUs without MIG
        mig_enabled = False
    return GpuInfo(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        capability=(int(major), int(minor)),
        memory_total_bytes=total,
        memory_free_bytes=free,
        driver_version=driver,
        uuid=uuid,
        source="nvml",
        usable_by_torch=False,
        mig_enabled=mig_enabled,
    )


# -- torch -----------------------------------------------------------------------------------


def read_torch_cuda(cuda: Any, *, free_memory: bool = True) -> tuple[list[GpuInfo], str]:
    """Read the GPUs this torch process can use. Returns (gpus, status); never raises.

    ``free_memory`` asks torch for free memory, which creates a CUDA context on every GPU:
    only worth it when NVML cannot tell.
    """
    try:
        if not cuda.is_available():
            return [], "torch sees no CUDA device"
        gpus, problems = [], []
        for index in range(cuda.device_count()):
            try:  # one broken GPU must not hide the others (found by a hunt), as in read_nvml
                props = cuda.get_device_properties(index)
            except Exception as error:  # noqa: BLE001
                problems.append(f"cuda:{index}: {type(error).__name__}: {error}")
                continue
            free = None
            if free_memory:
                try:
                    free, _ = cuda.mem_get_info(index)
                except Exception:  # noqa: BLE001
                    free = None
            uuid = getattr(props, "uuid", None)
            # a ROCm GPU is one whatever its properties hold: NVIDIA's table must not judge it
            rocm_arch = getattr(props, "gcnArchName", "gfx?") if torch.version.hip else None
            gpus.append(
                GpuInfo(
                    index=index,
                    name=str(props.name),
                    capability=(int(props.major), int(props.minor)),
                    memory_total_bytes=int(props.total_memory),
                    memory_free_bytes=None if free is None else int(free),
                    driver_version=None,
                    uuid=None if uuid is None else str(uuid),
                    source="torch",
                    usable_by_torch=True,
                    rocm_arch=None if rocm_arch is None else str(rocm_arch).split(":")[0],
                )
            )
        return gpus, "ok" if not problems else "partial (" + "; ".join(problems) + ")"
    except Exception as error:  # noqa: BLE001 - a broken CUDA setup is a fact, not a crash
        return [], f"torch CUDA query failed ({type(error).__name__}: {error})"


def _uuid_key(uuid: str | None) -> str | None:
    return None if uuid is None else uuid.lower().removeprefix("gpu-")


def merge_gpus(nvml_gpus: list[GpuInfo], torch_gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Combine NVML and torch views: torch decides which GPUs are usable, NVML adds facts
    (with no GPU torch can use: NVML's, none usable).

    A torch GPU takes the NVML GPU of its UUID. Where one side has no UUID, the NVML GPU at
    the same index, only when both list every GPU and that one has the same name and compute
    capability (NVML numbers GPUs in PCI bus order, CUDA fastest first). UUIDs that differ
    never match: a MIG instance (torch: its own UUID, name and memory) is not its parent
    GPU, which NVML lists."""
    if not torch_gpus:
        return list(nvml_gpus)
    by_uuid = {_uuid_key(gpu.uuid): gpu for gpu in nvml_gpus if gpu.uuid}
    same_view = "CUDA_VISIBLE_DEVICES" not in os.environ and len(nvml_gpus) == len(torch_gpus)
    merged = []
    for torch_gpu in torch_gpus:
        nvml_gpu = by_uuid.get(_uuid_key(torch_gpu.uuid))
        if nvml_gpu is None and same_view:
            at_index = nvml_gpus[torch_gpu.index]
            if (
                (torch_gpu.uuid is None or at_index.uuid is None)
                and at_index.name == torch_gpu.name
                and at_index.capability == torch_gpu.capability
            ):
                nvml_gpu = at_index
        if nvml_gpu is None:
            merged.append(torch_gpu)
        else:
            merged.append(
                nvml_gpu.model_copy(update={"index": torch_gpu.index, "usable_by_torch": True})
            )
    return merged


HIDING_VALUES = ("", "-1", "NoDevFiles")
"""``CUDA_VISIBLE_DEVICES`` values that hide every GPU. Any other value is blamed only as a
possibility: SLURM and Kubernetes set it on every GPU job."""


def unusable_gpus_note(
    count: int,
    torch_version: str,
    cuda_runtime: str | None,
    hip_runtime: str | None = None,
    mig_gpus: int = 0,
) -> str:
    """Why torch cannot use the NVIDIA GPUs NVML sees, by what this torch is; ``mig_gpus``
    of them in MIG mode."""
    if hip_runtime is not None:
        return (
            f"NVML sees {count} NVIDIA GPU(s) but torch {torch_version} is a ROCm build "
            f"(HIP {hip_runtime}): install a CUDA build of torch to train on them"
        )
    if cuda_runtime is None:
        return (
            f"NVML sees {count} GPU(s) but torch {torch_version} is a CPU build: install a "
            "CUDA build of torch to train on the GPU"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in HIDING_VALUES:
        return (
            f"NVML sees {count} GPU(s) but CUDA_VISIBLE_DEVICES={visible!r} hides them from "
            f"torch {torch_version}"
        )
    if mig_gpus:  # blamed on the driver (found by a hunt)
        return (
            f"NVML sees {count} GPU(s), {mig_gpus} of them in MIG mode, but torch "
            f"{torch_version} (CUDA {cuda_runtime}) sees no CUDA device: a GPU in MIG mode "
            "shows CUDA only its MIG instances. Create one (`nvidia-smi mig -cgi <profile> "
            "-C`) and name it in CUDA_VISIBLE_DEVICES (its MIG-<uuid> from `nvidia-smi -L`), "
            "or turn MIG off (`nvidia-smi -i <index> -mig 0`)"
        )
    also = (
        f"; or CUDA_VISIBLE_DEVICES={visible!r} names no GPU NVML lists"
        if visible is not None
        else ""
    )
    return (
        f"NVML sees {count} GPU(s) but torch {torch_version} (CUDA {cuda_runtime}) cannot "
        "initialise CUDA: most often a driver older than that CUDA runtime needs; update the "
        f"driver, or install a torch built for an older CUDA{also}"
    )


def detect_hardware(
    *,
    pynvml: ModuleType | Literal["auto"] | None = "auto",
    cuda: Any = None,
    cpu: CpuInfo | None = None,
) -> HardwareInfo:
    """Describe this machine. Arguments exist for tests: inject NVML, torch.cuda or the CPU."""
    if pynvml == "auto":
        pynvml, nvml_status = load_pynvml()
    else:
        nvml_status = "ok" if pynvml is not None else "pynvml not given"
    nvml_gpus: list[GpuInfo] = []
    driver = None
    if pynvml is not None:
        nvml_gpus, driver, nvml_status = read_nvml(pynvml)
    cuda = torch.cuda if cuda is None else cuda
    torch_gpus, torch_status = read_torch_cuda(cuda, free_memory=not nvml_gpus)
    gpus = merge_gpus(nvml_gpus, torch_gpus)
    notes = []
    if torch_status.startswith("torch CUDA query failed"):
        notes.append(torch_status)
    elif torch_status.startswith("partial"):
        notes.append(f"torch could not read every GPU, left out: {torch_status[9:-1]}")
    elif nvml_gpus and not torch_gpus:
        notes.append(
            unusable_gpus_note(
                len(nvml_gpus),
                torch.__version__,
                torch.version.cuda,
                torch.version.hip,
                mig_gpus=sum(gpu.mig_enabled for gpu in nvml_gpus),
            )
        )
    return HardwareInfo(
        torch_version=torch.__version__,
        torch_cuda_runtime=torch.version.cuda,
        torch_hip_runtime=torch.version.hip,
        cuda_available=bool(torch_gpus),
        nvml_status=nvml_status,
        driver_version=driver,
        gpus=tuple(gpus),
        cpu=cpu if cpu is not None else read_cpu(),
        platform=platform.platform(),
        python_version=sys.version.split()[0],
        warnings=tuple(notes),
    )
