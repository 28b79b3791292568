from __future__ import annotations

import pytest
import torch

from autoprec.cpu_info import check_cpu_autocast
from autoprec.hardware import (
    FORMAT_MIN_CAPABILITY,
    capability_formats,
    detect_hardware,
    merge_gpus,
    read_nvml,
    read_torch_cuda,
)
from tests.conftest import (
    CPU,
    KNOWN_GPUS,
    FakeCuda,
    FakeNvml,
    FakeNvmlDevice,
    make_hardware,
    nvml_error,
)

# GPU -> formats it must support; every format not listed must be unsupported.
EXPECTED_FORMATS = {
    "V100": {"fp16_tensor_cores"},
    "T4": {"fp16_tensor_cores"},
    "A100": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4"},
    "RTX3090": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4"},
    "RTX4090": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8"},
    "L4": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8"},
    "H100": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8"},
    "H200": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8"},
    "B200": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8", "mxfp8", "fp4"},
    "RTX5090": {"fp16_tensor_cores", "bf16", "tf32", "sparse_2_4", "fp8", "mxfp8", "fp4"},
}


@pytest.mark.parametrize("gpu", sorted(EXPECTED_FORMATS))
def test_capability_table(gpu: str) -> None:
    name, capability, _ = KNOWN_GPUS[gpu]
    formats = capability_formats(capability, name)
    assert {f.format for f in formats} == set(FORMAT_MIN_CAPABILITY)
    assert {f.format for f in formats if f.supported} == EXPECTED_FORMATS[gpu]
    for support in formats:
        assert support.reason.endswith(f"(found: {name}, {capability[0]}.{capability[1]})")


@pytest.mark.parametrize(
    ("capability", "fp8"), [((8, 6), False), ((8, 9), True), ((9, 0), True), ((12, 0), True)]
)
def test_fp8_boundary(capability: tuple[int, int], fp8: bool) -> None:
    support = {f.format: f.supported for f in capability_formats(capability)}
    assert support["fp8"] is fp8


def test_read_nvml_reads_every_device() -> None:
    nvml = FakeNvml(
        devices=[
            FakeNvmlDevice("NVIDIA H100 80GB HBM3", (9, 0), uuid="GPU-aaaa"),
            FakeNvmlDevice("NVIDIA A100-SXM4-80GB", (8, 0), uuid="GPU-bbbb"),
        ]
    )
    gpus, driver, status = read_nvml(nvml)
    assert status == "ok"
    assert driver == "570.86.15"
    assert [(g.name, g.capability, g.source) for g in gpus] == [
        ("NVIDIA H100 80GB HBM3", (9, 0), "nvml"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "nvml"),
    ]
    assert gpus[0].memory_free_bytes == 70 * 2**30
    assert nvml.shutdowns == 1


@pytest.mark.parametrize("error", ["LibraryNotFound", "DriverNotLoaded", "NoPermission"])
def test_nvml_init_failure_is_a_status_not_an_error(error: str) -> None:
    gpus, driver, status = read_nvml(FakeNvml(init_error=nvml_error(error)))
    assert gpus == [] and driver is None
    assert status.startswith("NVML unavailable") and error in status


def test_one_broken_gpu_does_not_hide_the_others() -> None:
    nvml = FakeNvml(
        devices=[
            FakeNvmlDevice("NVIDIA H100", (9, 0), broken=nvml_error("GpuIsLost")),
            FakeNvmlDevice("NVIDIA L4", (8, 9), memory_error=nvml_error("NotSupported")),
        ]
    )
    gpus, _, status = read_nvml(nvml)
    assert [gpu.name for gpu in gpus] == ["NVIDIA L4"]
    assert gpus[0].memory_total_bytes is None
    assert status.startswith("partial") and "GPU 0" in status and "GpuIsLost" in status
    assert nvml.shutdowns == 1


def test_one_gpu_torch_cannot_read_does_not_hide_the_others() -> None:
    """Found by a hunt: one failing get_device_properties() left torch no GPU at all (with
    NVML: every GPU unusable, cuda:0 healthy), and a failed driver query was silent."""
    healthy = FakeNvmlDevice("NVIDIA H100 80GB HBM3", (9, 0), uuid="GPU-1")
    lost = FakeNvmlDevice("NVIDIA L4", (8, 9), uuid="GPU-2", broken=RuntimeError("GPU lost"))
    nvml = FakeNvml(devices=[healthy], driver=nvml_error("Unknown"))
    hardware = detect_hardware(pynvml=nvml, cuda=FakeCuda(devices=[healthy, lost]), cpu=CPU)
    assert [(gpu.name, gpu.usable_by_torch) for gpu in hardware.gpus] == [
        ("NVIDIA H100 80GB HBM3", True)
    ]
    assert hardware.resolve_device(None) == "cuda:0"
    assert hardware.warnings == (
        "torch could not read every GPU, left out: cuda:1: RuntimeError: GPU lost",
    )
    assert hardware.nvml_status.startswith("partial (driver version: NVMLError_Unknown")


def test_torch_fallback_when_nvml_fails() -> None:
    cuda = FakeCuda(devices=[FakeNvmlDevice("NVIDIA H100 80GB HBM3", (9, 0))])
    hardware = detect_hardware(
        pynvml=FakeNvml(init_error=nvml_error("LibraryNotFound")), cuda=cuda, cpu=CPU
    )
    (gpu,) = hardware.gpus
    assert gpu.source == "torch" and gpu.usable_by_torch
    assert gpu.capability == (9, 0)
    assert gpu.memory_free_bytes == 70 * 2**30  # from torch.cuda.mem_get_info
    assert "LibraryNotFound" in hardware.nvml_status
    assert hardware.cuda_available


def test_nvml_facts_win_when_both_see_the_gpu() -> None:
    device = FakeNvmlDevice("NVIDIA H100 80GB HBM3", (9, 0), uuid="GPU-1234")
    hardware = detect_hardware(
        pynvml=FakeNvml(devices=[device]), cuda=FakeCuda(devices=[device]), cpu=CPU
    )
    (gpu,) = hardware.gpus
    assert gpu.source == "nvml" and gpu.usable_by_torch
    assert gpu.driver_version == "570.86.15"


def test_nvml_gpu_with_cpu_build_of_torch_warns() -> None:
    nvml = FakeNvml(devices=[FakeNvmlDevice("NVIDIA A100-SXM4-80GB", (8, 0))])
    hardware = detect_hardware(pynvml=nvml, cuda=FakeCuda(), cpu=CPU)
    (gpu,) = hardware.gpus
    assert not gpu.usable_by_torch
    assert any("is a CPU build: install a CUDA build" in w for w in hardware.warnings)
    assert hardware.resolve_device(None) == "cpu"
    with pytest.raises(ValueError, match="no CUDA device usable by torch"):
        hardware.resolve_device("cuda:0")


def test_broken_torch_cuda_is_recorded() -> None:
    gpus, status = read_torch_cuda(FakeCuda(error=RuntimeError("CUDA driver too old")))
    assert gpus == []
    assert "CUDA driver too old" in status


def test_merge_matches_by_uuid_across_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    first = FakeNvmlDevice("NVIDIA A100", (8, 0), uuid="GPU-aaaa")
    second = FakeNvmlDevice("NVIDIA H100", (9, 0), uuid="GPU-bbbb")
    nvml_gpus, _, _ = read_nvml(FakeNvml(devices=[first, second]))
    torch_gpus, _ = read_torch_cuda(FakeCuda(devices=[second]))
    merged = merge_gpus(nvml_gpus, torch_gpus)
    assert [(g.index, g.name, g.source) for g in merged] == [(0, "NVIDIA H100", "nvml")]


def test_detect_hardware_on_this_machine() -> None:
    hardware = detect_hardware()
    assert hardware.torch_version == torch.__version__
    assert hardware.cpu.logical_cores >= 1
    assert {check.dtype for check in hardware.cpu.autocast} == {"bfloat16", "float16"}
    if not torch.cuda.is_available():
        assert not hardware.cuda_available
        assert hardware.resolve_device(None) == "cpu"


def test_cpu_autocast_detection_really_runs() -> None:
    bf16 = check_cpu_autocast("bfloat16")
    assert bf16.works, bf16.error  # torch's CPU build has bf16 autocast on every x86/ARM CPU


def test_cpu_autocast_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_autocast(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CPU autocast does not support float16")

    monkeypatch.setattr(torch, "autocast", broken_autocast)
    check = check_cpu_autocast("float16")
    assert not check.works
    assert check.error == "RuntimeError: CPU autocast does not support float16"


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (None, "cuda:0"),
        ("cpu", "cpu"),
        ("cpu:0", "cpu"),  # refused by probe while tune and check took it
        ("cuda", "cuda:0"),
        (1, "cuda:1"),
        ("CUDA:1", "cuda:1"),
    ],
)
def test_resolve_device(device: object, expected: str) -> None:
    assert make_hardware("H100", "A100").resolve_device(device) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:2", "not available: this machine has 2 CUDA device"),
        ("gpu0", "must be 'cpu'"),
        ("cpu:1", "must be 'cpu'"),
    ],
)
def test_resolve_device_rejects(device: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_hardware("H100", "A100").resolve_device(device)


def test_a_mig_instance_keeps_its_own_facts_not_its_parent_gpus() -> None:
    """NVML lists the physical A100; torch sees the 1g.10gb slice with its own UUID. Matched by
    index (one GPU each), the slice was reported as the whole 80 GB GPU."""
    parent = FakeNvmlDevice("NVIDIA A100-SXM4-80GB", (8, 0), total=80 * 2**30, uuid="GPU-aaaa")
    mig = FakeNvmlDevice(
        "NVIDIA A100-SXM4-80GB MIG 1g.10gb", (8, 0), total=9984 * 2**20, uuid="GPU-bbbb"
    )
    hardware = detect_hardware(
        pynvml=FakeNvml(devices=[parent]), cuda=FakeCuda(devices=[mig]), cpu=CPU
    )
    (gpu,) = hardware.gpus
    assert gpu.name.endswith("MIG 1g.10gb") and gpu.source == "torch"
    assert gpu.memory_total_bytes == 9984 * 2**20


def test_without_uuids_only_the_same_gpu_at_an_index_is_merged() -> None:
    """NVML numbers GPUs in PCI bus order, CUDA fastest first: cuda:0 is the H100 where NVML's
    index 0 is the A100. Without UUIDs the index match gave the H100 the A100's facts and FP8
    was refused on it."""

    class NoUuids(FakeNvml):
        def nvmlDeviceGetUUID(self, handle: object) -> str:
            raise nvml_error("NotSupported")

    a100 = FakeNvmlDevice("NVIDIA A100-SXM4-80GB", (8, 0), uuid="GPU-aaaa")
    h100 = FakeNvmlDevice("NVIDIA H100 80GB HBM3", (9, 0), uuid="GPU-bbbb")
    hardware = detect_hardware(
        pynvml=NoUuids(devices=[a100, h100]), cuda=FakeCuda(devices=[h100, a100]), cpu=CPU
    )
    assert [(g.name, g.capability) for g in hardware.gpus] == [
        ("NVIDIA H100 80GB HBM3", (9, 0)),
        ("NVIDIA A100-SXM4-80GB", (8, 0)),
    ]
    same = detect_hardware(pynvml=NoUuids(devices=[h100]), cuda=FakeCuda(devices=[h100]), cpu=CPU)
    assert same.gpus[0].source == "nvml"  # the same GPU: NVML's facts (driver) are added


def test_a_cuda_build_that_cannot_start_cuda_is_not_told_to_install_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch cu128 with an old driver: CUDA unavailable, and the note said "a CPU build of
    torch ... install a CUDA build". With the query itself failing both notes printed."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(devices=[FakeNvmlDevice("NVIDIA A100-SXM4-80GB", (8, 0))], driver="470.82.01")
    (note,) = detect_hardware(pynvml=nvml, cuda=FakeCuda(), cpu=CPU).warnings
    assert "CUDA 12.8" in note and "update the" in note and "CPU build" not in note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (note,) = detect_hardware(pynvml=nvml, cuda=FakeCuda(), cpu=CPU).warnings
    assert "CUDA_VISIBLE_DEVICES='' hides them" in note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # as SLURM sets it: not the cause named
    (note,) = detect_hardware(pynvml=nvml, cuda=FakeCuda(), cpu=CPU).warnings
    assert "update the driver" in note and "CUDA_VISIBLE_DEVICES='0' names no GPU" in note
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    (note,) = detect_hardware(pynvml=nvml, cuda=FakeCuda(), cpu=CPU).warnings
    assert "is a ROCm build (HIP 6.4.43482)" in note
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    broken = FakeCuda(error=RuntimeError("all CUDA-capable devices are busy or unavailable"))
    (note,) = detect_hardware(pynvml=nvml, cuda=broken, cpu=CPU).warnings
    assert note.startswith("torch CUDA query failed")


def test_a_gpu_in_mig_mode_without_an_instance_is_not_blamed_on_the_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MIG mode with no instance created: CUDA sees no device, and the note said "most often
    a driver older than that CUDA runtime needs" (found by a hunt)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a100 = FakeNvmlDevice("NVIDIA A100-SXM4-80GB", (8, 0), mig=True)
    hardware = detect_hardware(pynvml=FakeNvml(devices=[a100]), cuda=FakeCuda(), cpu=CPU)
    (note,) = hardware.warnings
    assert "1 of them in MIG mode" in note and "nvidia-smi mig -cgi" in note
    assert "driver" not in note
    assert hardware.gpus[0].mig_enabled
