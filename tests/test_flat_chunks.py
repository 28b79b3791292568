from __future__ import annotations

import torch

from autoprec import flat_chunks
from autoprec.flat_chunks import chunks, gather, pieces, scatter


def test_chunks_keep_order_within_a_key_and_cut_at_the_limit() -> None:
    sizes = [3, 4, 2, 9, 1, 1]
    tensors = [
        torch.zeros(size, dtype=torch.float32 if i != 2 else torch.bfloat16)
        for i, size in enumerate(sizes)
    ]
    runs = chunks(tensors, key=lambda t: t.dtype, limit=5)
    as_sizes = [[t.numel() for t in run] for run in runs]
    # fp32: 3 | 4 | 9 (larger than the limit: its own run) | 1 1; bf16: 2
    assert as_sizes == [[3], [4], [9], [1, 1], [2]]
    assert chunks([], key=lambda t: t.dtype) == []


def test_a_gpu_chunk_holds_no_more_than_its_largest_tensor_and_a_cpu_one_stays_in_cache() -> None:
    """Off the CPU (meta tensors stand in for a GPU's) a chunk holds no more elements than the
    largest tensor beside it, so the step's temporaries stay the per-tensor loop's; on a CPU
    chunks hold up to ``CPU_CHUNK_ELEMENTS``."""
    sizes = [10, 30, 5, 20, 25]
    gpu = [torch.empty(size, device="meta") for size in sizes]
    assert flat_chunks.chunk_elements(gpu) == 30
    runs = chunks(gpu, key=lambda t: t.device)
    assert [[t.numel() for t in run] for run in runs] == [[10], [30], [5, 20], [25]]
    cpu = [torch.zeros(size) for size in sizes]
    assert flat_chunks.chunk_elements(cpu) == flat_chunks.CPU_CHUNK_ELEMENTS
    assert len(chunks(cpu, key=lambda t: t.device)) == 1
    half = flat_chunks.CPU_CHUNK_ELEMENTS // 2 + 1
    assert len(chunks([torch.zeros(half) for _ in range(3)], key=lambda t: t.device)) == 3


def test_gather_and_scatter_round_trip_every_dtype_and_layout() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 4, generator=generator),
        torch.randn(5, generator=generator, dtype=torch.complex64),
        torch.randn(4, 6, generator=generator).t(),  # non-contiguous
    ]
    flat = gather(tensors)
    assert flat.dtype == torch.float32 and flat.numel() == 12 + 10 + 24
    assert all(
        piece.data_ptr() != t.data_ptr()
        for piece, t in zip(pieces(flat, tensors), tensors, strict=True)
    )
    targets = [torch.zeros_like(t) for t in tensors]
    scatter(flat, targets)
    assert all(torch.equal(a, b) for a, b in zip(targets, tensors, strict=True))
    one = torch.randn(7, generator=generator)
    before = one.clone()
    gather([one]).add_(1)  # a new tensor, never the weight itself
    assert torch.equal(one, before)


def test_a_tensor_subclass_is_a_chunk_of_its_own() -> None:
    """FSDP2's DTensor shards and other tensor subclasses are never concatenated."""

    class Shard(torch.Tensor):
        pass

    plain = [torch.zeros(2), torch.zeros(3)]
    shards = [torch.zeros(2).as_subclass(Shard), torch.zeros(3).as_subclass(Shard)]
    assert flat_chunks.alone(shards[0]) and not flat_chunks.alone(torch.nn.Parameter(plain[0]))
    runs = chunks([*plain, *shards], key=lambda t: t.device)
    assert [len(run) for run in runs] == [2, 1, 1]
