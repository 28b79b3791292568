"""`autoprec probe`'s tables: the machine, its GPUs and formats, the backends, the model's
layer mix and every mode's verdict with its reasons."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from autoprec.display import format_bytes, format_count, format_percent, yes_no
from autoprec.hardware import GpuInfo, HardwareInfo
from autoprec.layer_keep import FP8_SKIP_REASONS, PURE_BF16_KEEP_REASONS
from autoprec.layer_mix import LayerMix
from autoprec.probing import ModeVerdict, ProbeReport


def _hardware(hardware: HardwareInfo, device: str) -> Table:
    table = Table(title="Machine", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    if hardware.torch_hip_runtime is not None:
        runtime = f"ROCm/HIP runtime: {hardware.torch_hip_runtime}"
    else:
        runtime = f"CUDA runtime: {hardware.torch_cuda_runtime or 'none (CPU build)'}"
    table.add_row("torch", f"{hardware.torch_version} ({runtime})")
    table.add_row("NVIDIA driver", hardware.driver_version or "—")
    table.add_row("NVML", Text(hardware.nvml_status))
    cpu = hardware.cpu
    table.add_row(
        "CPU",
        f"{cpu.model_name}, {cpu.usable_cores} of {cpu.logical_cores} cores usable, "
        f"{format_bytes(cpu.memory_total_bytes)} RAM",
    )
    autocast = ", ".join(
        f"{check.dtype} {'works' if check.works else 'fails: ' + (check.error or '?')}"
        + (_bf16_instructions(cpu.native_bf16) if check.dtype == "bfloat16" else "")
        for check in cpu.autocast
    )
    table.add_row("CPU autocast", Text(autocast or "not checked"))
    table.add_row("verdicts for", device)
    return table


def _bf16_instructions(native: bool | None) -> str:
    """Whether bf16 runs on instructions of its own (``CpuInfo.native_bf16``): without them
    "bfloat16 works" hid a 14-17x slower step, said only in each bf16 mode's reasons."""
    if native is None:
        return ""
    if native:
        return " (native bf16 instructions)"
    return " (no bf16 instructions: far slower than fp32)"


def _gpus(gpus: tuple[GpuInfo, ...]) -> Table:
    table = Table(title="GPUs", title_justify="left")
    for column in ("#", "name", "capability", "memory free / total", "source", "usable by torch"):
        table.add_column(column)
    for gpu in gpus:
        table.add_row(
            str(gpu.index),
            gpu.name,
            gpu.capability_str,
            f"{format_bytes(gpu.memory_free_bytes)} / {format_bytes(gpu.memory_total_bytes)}",
            gpu.source,
            yes_no(gpu.usable_by_torch),
        )
    return table


def _formats(gpu: GpuInfo) -> Table:
    table = Table(title=f"Tensor-core formats on cuda:{gpu.index}", title_justify="left")
    table.add_column("format")
    table.add_column("supported")
    table.add_column("needs")
    for support in gpu.formats():
        table.add_row(support.format, yes_no(support.supported), Text(support.reason))
    return table


def _backends(report: ProbeReport) -> Table:
    table = Table(title="Optional backends", title_justify="left")
    for column in ("backend", "version", "used for", "install"):
        table.add_column(column)
    for backend in report.backends:
        if backend.import_error:
            version = Text(f"{backend.version} (import fails)", style="red")
        elif backend.installed:
            version = Text(backend.version or "?", style="green")
        else:
            version = Text("not installed", style="dim")
        install = "" if backend.installed else f"pip install 'autoprec[{backend.extra}]'"
        table.add_row(backend.name, version, Text(backend.purpose), Text(install))
    return table


def _layers(layers: LayerMix) -> Group:
    flops = "FLOPs unknown (no forward pass)"
    if layers.forward_flops is not None:
        flops = f"{format_count(layers.forward_flops)} FLOPs per forward"
    if layers.forward_flops == 0:
        flops = "no matmul FLOPs"
    table = Table(
        title=f"Model: {layers.model_class}, {format_count(layers.parameters)} parameters, {flops}",
        title_justify="left",
    )
    for column in ("layer kind", "parameters", "param share", "FLOP share"):
        table.add_column(column, justify="right" if column != "layer kind" else "left")
    for share in layers.by_kind:
        if share.parameters or share.flops:
            table.add_row(
                share.kind,
                format_count(share.parameters),
                format_percent(share.parameter_share),
                format_percent(share.flop_share),
            )
    findings = Text("\n".join(f"• {finding}" for finding in layers.findings))
    return Group(table, findings, _kept_by_default(layers))


def _kept_by_default(layers: LayerMix) -> Text:
    """Which modules each family of modes keeps out of low precision, and where they run."""

    def named(reasons: tuple[str, ...]) -> str:
        # the root's name is "": it showed as "none" (found by a hunt)
        names = [name or "the whole model (its root)" for name in layers.kept_for(reasons)]
        return ", ".join(names) or "none"

    return Text(
        f"pure bf16 keeps in fp32: {named(PURE_BF16_KEEP_REASONS)}\n"
        f"FP8 keeps out of FP8 (bf16 autocast): {named(FP8_SKIP_REASONS)}",
        style="dim",
    )


def _verdict_text(verdict: ModeVerdict) -> Text:
    if not verdict.eligible:
        return Text("no", style="red")
    if verdict.worth_trying:
        return Text("try", style="green")
    return Text("possible", style="yellow")


def _modes(report: ProbeReport) -> Table:
    table = Table(title="Precision modes", title_justify="left", show_lines=True)
    table.add_column("mode", style="bold")
    table.add_column("verdict")
    table.add_column("why")
    for verdict in (*report.modes, report.optimizer_8bit):
        why = Text()
        for reason in verdict.reasons:
            why.append(f"✗ {reason}\n", style="red")
        for note in verdict.notes:
            why.append(f"· {note}\n")
        why.rstrip()
        table.add_row(verdict.name, _verdict_text(verdict), why or Text(verdict.description))
    return table


def print_probe_report(report: ProbeReport, console: Console | None = None) -> None:
    """Print a ProbeReport as tables."""
    console = console or Console()
    console.print(_hardware(report.hardware, report.device))
    if report.hardware.gpus:
        console.print(_gpus(report.hardware.gpus))
    if report.device != "cpu":
        console.print(_formats(report.hardware.gpu(int(report.device.split(":")[1]))))
    for warning in report.hardware.warnings:
        console.print(Panel(Text(warning), title="warning", style="yellow"))
    console.print(_backends(report))
    if report.layers is not None:
        console.print(_layers(report.layers))
    console.print(_modes(report))
    summary = ", ".join(v.name for v in report.modes if v.worth_trying) or "fp32 only"
    console.print(
        f"Worth a trial here: [bold]{summary}[/bold]  (probe took {report.seconds:.2f} s)"
    )
