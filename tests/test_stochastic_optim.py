from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from autoprec.stochastic_optim import StochasticAdamW, StochasticSGD


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize(
    ("cls", "decoupled"), [(torch.optim.AdamW, True), (torch.optim.Adam, False)]
)
def test_fp32_parameters_follow_torch_exactly(
    cls: type, decoupled: bool, dtype: torch.dtype
) -> None:
    # complex: torch updates the real and imaginary parts as two real numbers (a Fourier
    # layer's weights); taking .float() of them would drop the imaginary parts
    options = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.05}
    _assert_follows(
        lambda p: StochasticAdamW(p, decoupled_weight_decay=decoupled, **options),
        lambda p: cls(p, **options),
        dtype,
    )


def _assert_follows(
    ours_from: Callable, theirs_from: Callable, dtype: torch.dtype = torch.float32
) -> None:
    """20 steps of both optimizers on the same fp32 (or complex64) weights and gradients end
    equal."""
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(64, 32, dtype=dtype))
    theirs = torch.nn.Parameter(ours.detach().clone())
    a, b = ours_from([ours]), theirs_from([theirs])
    for step in range(20):
        grad = torch.randn(64, 32, dtype=dtype, generator=torch.Generator().manual_seed(step))
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_stochastic_rounding_keeps_updates_that_nearest_rounding_loses() -> None:
    """Weights of 1.0 with updates of 1e-4: half a bf16 ulp at 1.0 is 0.0039, so nearest
    rounding never moves them; stochastic rounding moves them by the right amount on average."""
    torch.manual_seed(0)
    steps, lr = 200, 1e-4
    results = {}
    for name, make in {
        "nearest": lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0),
        "sr": lambda p: StochasticAdamW(p, lr=lr, weight_decay=0.0),
        "sr_kahan": lambda p: StochasticAdamW(p, lr=lr, weight_decay=0.0, kahan=True),
    }.items():
        weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        optimizer = make([weight])
        for _ in range(steps):
            weight.grad = torch.ones_like(weight)  # Adam step = lr each time
            optimizer.step()
        results[name] = (1.0 - weight.detach().float()).mean().item()
    intended = steps * lr  # 0.02
    assert results["nearest"] == 0.0
    assert results["sr"] == pytest.approx(intended, rel=0.1)
    assert results["sr_kahan"] == pytest.approx(intended, rel=0.02)


def test_state_is_bf16_for_bf16_parameters() -> None:
    weight = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    optimizer = StochasticAdamW([weight], kahan=True)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    state = optimizer.state[weight]
    assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "compensation")} == {torch.bfloat16}


def test_invalid_arguments() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="betas must be in"):
        StochasticAdamW([weight], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="must be >= 0"):
        StochasticAdamW([weight], lr=-1.0)


def _steps(optimizer: StochasticAdamW, weight: torch.Tensor, count: int) -> None:
    for step in range(count):
        weight.grad = torch.full_like(weight, 1e-3 * (step + 1))
        optimizer.step()


def test_a_checkpoint_carries_the_rounding_stream() -> None:
    weight = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    optimizer = StochasticAdamW([weight], lr=1e-4, seed=3)
    _steps(optimizer, weight, 3)
    saved_weight, saved = weight.detach().clone(), copy.deepcopy(optimizer.state_dict())
    assert set(saved["rounding_rng"]) == {"cpu"}
    _steps(optimizer, weight, 3)
    resumed = torch.nn.Parameter(saved_weight.clone())
    again = StochasticAdamW([resumed], lr=1e-4, seed=3)
    again.load_state_dict(saved)
    _steps(again, resumed, 3)
    assert torch.equal(resumed, weight)  # the same noise as the uninterrupted run
    # a checkpoint without the stream (torch's own AdamW) loads; the stream starts from seed
    plain_weight = torch.nn.Parameter(torch.ones(256))
    plain = torch.optim.AdamW([plain_weight], lr=1e-4)
    _steps(plain, plain_weight, 2)  # type: ignore[arg-type]
    bf16 = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    fresh = StochasticAdamW([bf16], lr=1e-4, kahan=True)
    fresh.load_state_dict(plain.state_dict())
    assert fresh.state_dict()["rounding_rng"] == {}
    _steps(fresh, bf16, 2)
    assert fresh.state[bf16]["compensation"].dtype == torch.bfloat16  # Kahan stays on
    assert fresh.state[bf16]["exp_avg_sq"].dtype == torch.bfloat16
    # Kahan is the optimizer's own, not the checkpoint's: a bf16_sr_kahan checkpoint loaded
    # into bf16_sr's optimizer trained on with the buffer (the checkpoint's kahan=True)
    plain_sr = StochasticAdamW([bf16], lr=1e-4)
    plain_sr.load_state_dict(fresh.state_dict())
    assert plain_sr.param_groups[0]["kahan"] is False
    assert "compensation" not in plain_sr.state[bf16]
    _steps(plain_sr, bf16, 1)
    assert "compensation" not in plain_sr.state[bf16]
    kahan_again = StochasticAdamW([bf16], lr=1e-4, kahan=True)
    kahan_again.load_state_dict(plain_sr.state_dict())
    assert kahan_again.param_groups[0]["kahan"] is True


@pytest.mark.parametrize(
    "options",
    [
        {"momentum": 0.9, "weight_decay": 0.05},
        {"momentum": 0.9, "dampening": 0.1},
        {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01},
        {},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_sgd_fp32_parameters_follow_torch_exactly(options: dict, dtype: torch.dtype) -> None:
    _assert_follows(
        lambda p: StochasticSGD(p, lr=1e-2, **options),
        lambda p: torch.optim.SGD(p, lr=1e-2, **options),
        dtype,
    )


def _sparse_steps(make: Callable, dtype: torch.dtype, steps: int = 10) -> torch.Tensor:
    """``steps`` of ``make``'s optimizer on an nn.Embedding(sparse=True) of ``dtype``, each
    looking up 16 of its 200 rows (rows 100 and above never)."""
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(200, 8, sparse=True).to(dtype)
    optimizer = make(embedding.parameters())
    for step in range(steps):
        rows = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(step))
        embedding(rows).float().pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return embedding.weight.detach()


@pytest.mark.parametrize("options", [{"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {}])
def test_sgd_takes_sparse_gradients_as_torch_does(options: dict) -> None:
    """nn.Embedding(sparse=True) under plain SGD trains in fp32 with torch's SGD; the rebuilt
    optimizer raised 'does not support sparse gradients', so bf16_sr failed its trial."""
    theirs = _sparse_steps(lambda p: torch.optim.SGD(p, lr=0.1, **options), torch.float32)
    ours = _sparse_steps(lambda p: StochasticSGD(p, lr=0.1, **options), torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    start = _sparse_steps(lambda p: StochasticSGD(p, lr=0.1, **options), torch.bfloat16, 0)
    rounded = _sparse_steps(lambda p: StochasticSGD(p, lr=0.1, **options), torch.bfloat16)
    assert torch.equal(rounded[100:], start[100:])  # rows never looked up: bit for bit
    assert (rounded[:100].float() - theirs[:100]).abs().mean() < 0.005  # bf16 ulp: 0.0078
    assert not torch.equal(rounded[:100], start[:100])


def test_adamw_refuses_sparse_gradients_as_torch_does() -> None:
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        _sparse_steps(lambda p: torch.optim.AdamW(p), torch.float32, 1)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        _sparse_steps(lambda p: StochasticAdamW(p), torch.float32, 1)


def test_sgd_stochastic_rounding_keeps_updates_that_nearest_rounding_loses() -> None:
    """SGD steps of 1e-4 on weights of 1.0 (half a bf16 ulp there is 0.0039)."""
    steps, lr = 200, 1e-4
    results = {}
    for name, make in {
        "nearest": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
        "sr": lambda p: StochasticSGD(p, lr=lr, momentum=0.9),
        "sr_kahan": lambda p: StochasticSGD(p, lr=lr, momentum=0.9, kahan=True),
        "fp32": lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
    }.items():
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        weight = torch.nn.Parameter(torch.ones(4096, dtype=dtype))
        optimizer = make([weight])
        for _ in range(steps):
            weight.grad = torch.full_like(weight, 0.1)  # momentum grows the step to 1e-4
            optimizer.step()
        results[name] = (1.0 - weight.detach().float()).mean().item()
        if name != "fp32":
            assert optimizer.state[weight]["momentum_buffer"].dtype == torch.bfloat16
    assert results["nearest"] == 0.0
    assert results["sr"] == pytest.approx(results["fp32"], rel=0.1)
    assert results["sr_kahan"] == pytest.approx(results["fp32"], rel=0.02)


def test_sgd_draws_from_its_own_stream_and_resumes_it() -> None:
    weight = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    optimizer = StochasticSGD([weight], lr=1e-4, momentum=0.9, seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    assert torch.equal(torch.get_rng_state(), before)  # the global stream is untouched
    saved, kept = copy.deepcopy(optimizer.state_dict()), weight.detach().clone()  # as saved
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    uninterrupted = weight.detach().clone()
    resumed = torch.nn.Parameter(kept)
    again = StochasticSGD([resumed], lr=1e-4, momentum=0.9, seed=3)
    again.load_state_dict(saved)
    resumed.grad = torch.ones_like(resumed)
    again.step()
    assert torch.equal(resumed.detach(), uninterrupted)


def test_sgd_invalid_arguments() -> None:
    weight = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="Nesterov momentum requires"):
        StochasticSGD([weight], nesterov=True)
    with pytest.raises(ValueError, match="must be >= 0"):
        StochasticSGD([weight], lr=-1.0)


def test_seeding_a_run_draws_on_the_cpu_as_torch_manual_seed_does() -> None:
    # seed_torch replaces torch.manual_seed (which reseeded every GPU of a multi-GPU machine
    # while only the run's own was put back); on the CPU its numbers are the same
    from autoprec.random_streams import seed_torch

    seed_torch(123, [])
    ours = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(ours, torch.rand(4))


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_8bit_moments_on_fp32_weights_follow_bitsandbytes_exactly(kind: str) -> None:
    """``state_bits=8`` keeps the moments as bitsandbytes' 8-bit optimizers keep them: on fp32
    weights (no rounding) 50 steps end bit for bit where AdamW8bit / Adam8bit / SGD8bit end,
    and away from 32-bit states (the 8-bit moments are really used)."""
    bnb = pytest.importorskip("bitsandbytes")
    adam = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8}
    if kind == "sgd":
        options = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
        ours_from = lambda p: StochasticSGD(p, state_bits=8, **options)  # noqa: E731
        theirs_from = lambda p: bnb.optim.SGD8bit(p, **options)  # noqa: E731
        full_from = lambda p: torch.optim.SGD(p, **options)  # noqa: E731
    else:
        decoupled = kind == "adamw"
        options = {**adam, "weight_decay": 0.05 if decoupled else 0.0}
        ours_from = lambda p: StochasticAdamW(  # noqa: E731
            p, state_bits=8, decoupled_weight_decay=decoupled, **options
        )
        eight_bit = bnb.optim.AdamW8bit if decoupled else bnb.optim.Adam8bit
        theirs_from = lambda p: eight_bit(p, **options)  # noqa: E731
        full_from = lambda p: torch.optim.AdamW(p, **options)  # noqa: E731
    torch.manual_seed(0)
    # 8192 and 5000 elements (over bitsandbytes' 4096-element floor; the second's last block
    # part full) and 64 (fp32 moments), updated in one chunk
    starts = [torch.randn(128, 64), torch.randn(100, 50), torch.randn(64)]
    weights = [[torch.nn.Parameter(start.clone()) for start in starts] for _ in range(3)]
    makers = (ours_from, theirs_from, full_from)
    optimizers = [make(w) for make, w in zip(makers, weights, strict=True)]
    for step in range(50):
        generator = torch.Generator().manual_seed(step)
        grads = [torch.randn(start.shape, generator=generator) for start in starts]
        for group, optimizer in zip(weights, optimizers, strict=True):
            for weight, grad in zip(group, grads, strict=True):
                weight.grad = grad.clone()
            optimizer.step()
    *eight_bit, small = zip(*weights, strict=True)
    for ours, theirs, full in eight_bit:
        assert torch.equal(ours, theirs)
        assert (ours - full).abs().max() > 1e-4
    # fp32 moments: bitsandbytes' 32-bit kernel orders its float operations otherwise
    torch.testing.assert_close(small[0], small[1], rtol=1e-6, atol=1e-6)
    state = optimizers[0].state[weights[0][1]]
    codes = [key for key in state if key.endswith("_codes")]
    assert codes and all(state[key].dtype == torch.uint8 for key in codes), sorted(state)


def test_8bit_moments_hold_a_quarter_of_bf16_ones_and_small_tensors_stay_fp32() -> None:
    pytest.importorskip("bitsandbytes")
    big = torch.nn.Parameter(torch.randn(128, 64, dtype=torch.bfloat16))
    small = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))  # under 4096 elements

    def state_bytes(state_bits: int) -> tuple[int, dict[str, torch.dtype]]:
        weights = [torch.nn.Parameter(big.detach().clone()), torch.nn.Parameter(small.detach())]
        optimizer = StochasticAdamW(weights, state_bits=state_bits)
        for weight in weights:
            weight.grad = torch.ones_like(weight)
        optimizer.step()
        sizes = [
            value.numel() * value.element_size()
            for state in optimizer.state.values()
            for key, value in state.items()
            if key != "step"
        ]
        return sum(sizes), {k: v.dtype for k, v in optimizer.state[weights[1]].items()}

    eight, small_state = state_bytes(8)
    sixteen, _ = state_bytes(32)
    # 8192 x 2 moments x 1 byte + 32 blocks x 2 x 4 bytes, + the small one's 64 x 2 x 4 (fp32)
    assert eight == 8192 * 2 + 32 * 2 * 4 + 64 * 2 * 4
    assert sixteen == (8192 + 64) * 2 * 2
    assert small_state == {
        "step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32
    }  # fmt: skip


def test_8bit_checkpoints_are_torch_layout_and_keep_their_storage() -> None:
    """A checkpoint of 8-bit moments holds torch's keys (fp32 moments, beside their block
    scales) and resumes exactly; torch's AdamW loads it; a ``bf16_sr`` (32-bit) checkpoint
    loaded into the 8-bit optimizer trains on with 8-bit moments, and an 8-bit one loaded into
    bf16_sr's with bf16 moments (``state_bits`` is the optimizer's, not the checkpoint's)."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    starts = [torch.randn(128, 64).bfloat16(), torch.randn(64).bfloat16()]  # 8-bit, fp32

    def trained(optimizer_from: Callable, steps: range, state: dict | None = None) -> tuple:
        weights = [torch.nn.Parameter(start.clone()) for start in starts]
        optimizer = optimizer_from(weights)
        if state is not None:
            for weight, saved in zip(weights, state["weights"], strict=True):
                weight.data.copy_(saved)
            optimizer.load_state_dict(state["optimizer"])
        for step in steps:
            for weight in weights:
                grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(step))
                weight.grad = grad.to(torch.bfloat16)
            optimizer.step()
        return weights, optimizer

    def checkpoint(weights: list, optimizer: torch.optim.Optimizer) -> dict:
        state = {"weights": [w.detach() for w in weights], "optimizer": optimizer.state_dict()}
        return copy.deepcopy(state)

    eight_bit = lambda p: StochasticAdamW(p, state_bits=8, seed=3)  # noqa: E731
    sixteen_bit = lambda p: StochasticAdamW(p, seed=3)  # noqa: E731
    straight, _ = trained(eight_bit, range(20))
    half, optimizer = trained(eight_bit, range(10))
    saved = checkpoint(half, optimizer)
    big, small = (saved["optimizer"]["state"][index] for index in (0, 1))
    assert {k: v.dtype for k, v in big.items()} == {
        "step": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
        "exp_avg_absmax": torch.float32, "exp_avg_sq_absmax": torch.float32,
    }  # fmt: skip
    assert set(small) == {"step", "exp_avg", "exp_avg_sq"}
    assert "exp_avg_codes" in optimizer.state[half[0]]  # saving did not touch the live state
    resumed, again = trained(eight_bit, range(10, 20), saved)
    for ours, theirs in zip(resumed, straight, strict=True):
        assert torch.equal(ours.detach(), theirs.detach())
    assert again.param_groups[0]["state_bits"] == 8
    assert sorted(again.state[resumed[0]]) == [
        "exp_avg_absmax", "exp_avg_codes", "exp_avg_sq_absmax", "exp_avg_sq_codes", "step"
    ]  # fmt: skip
    assert again.state[resumed[1]]["exp_avg"].dtype == torch.float32
    torch.optim.AdamW([torch.nn.Parameter(s.float()) for s in starts]).load_state_dict(
        saved["optimizer"]
    )  # torch's own optimizer takes it
    _, bf16_sr = trained(sixteen_bit, range(10))
    weights, loaded = trained(eight_bit, range(10, 11), checkpoint(half, bf16_sr))
    assert loaded.param_groups[0]["state_bits"] == 8
    assert loaded.state[weights[0]]["exp_avg_codes"].dtype == torch.uint8
    weights, back = trained(sixteen_bit, range(10, 11), saved)
    assert back.param_groups[0]["state_bits"] == 32
    assert sorted(back.state[weights[0]]) == ["exp_avg", "exp_avg_sq", "step"]
    assert back.state[weights[0]]["exp_avg"].dtype == torch.bfloat16


def test_8bit_moments_refuse_complex_parameters() -> None:
    pytest.importorskip("bitsandbytes")
    weight = torch.nn.Parameter(torch.randn(128, 64, dtype=torch.complex64))
    weight.grad = torch.randn_like(weight)
    with pytest.raises(ValueError, match="8-bit optimizer states take real parameters only"):
        StochasticAdamW([weight], state_bits=8).step()
    with pytest.raises(ValueError, match="state_bits must be 8 or 32 but got 16"):
        StochasticAdamW([weight], state_bits=16)
    # a 32-bit run's checkpoint loaded into 8-bit states: the moments lost their imaginary
    # part without a word and the next step failed in the quantiser (found by a hunt)
    thirty_two = StochasticAdamW([weight])
    thirty_two.step()
    eight = StochasticAdamW([weight], state_bits=8)
    with pytest.raises(ValueError, match="8-bit optimizer states take real parameters only"):
        eight.load_state_dict(copy.deepcopy(thirty_two.state_dict()))
    assert not eight.state  # nothing loaded


def _mixed_weights(
    dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[torch.nn.Parameter]:
    """Weights of several sizes (one larger than the test's chunks) and a non-contiguous one."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8,), (40, 30), (4, 4), (700,), (3,)]
    weights = [torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes]
    transposed = torch.randn(12, 20, generator=generator).to(device, dtype).t()  # non-contiguous
    return [torch.nn.Parameter(w) for w in [*weights, transposed]]


def _needs(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (found: CPU only)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize(
    ("ours_from", "theirs_from"),
    [
        (
            lambda p: StochasticAdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05),
            lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05),
        ),
        (
            lambda p: StochasticAdamW(p, lr=1e-2, weight_decay=0.05, decoupled_weight_decay=False),
            lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05),
        ),
        (
            lambda p: StochasticSGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True),
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True),
        ),
    ],
    ids=["adamw", "adam", "sgd"],
)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parameters_updated_in_chunks_follow_torch(
    ours_from: Callable,
    theirs_from: Callable,
    dtype: torch.dtype,
    device: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step updates parameters in chunks through flat buffers (``autoprec.flat_chunks``):
    on fp32 and complex weights (no rounding) every weight and moment ends bit for bit where
    one tensor a chunk puts it, and where torch's loop does (to float error: torch's Adam
    lerps the first moment), over several chunks, a weight larger than a chunk, a
    non-contiguous one, and weights that miss gradients at some steps (Adam's step counts and
    SGD's momentum buffers then differ within the group; benchmarks/gpu_session.sh runs it
    on a GPU)."""
    from autoprec import flat_chunks

    _needs(device)
    runs = []
    for limit in (500, 1):
        monkeypatch.setattr(flat_chunks, "chunk_elements", lambda tensors: limit)  # noqa: B023
        ours, theirs = _mixed_weights(dtype, device), _mixed_weights(dtype, device)
        mine, torchs = ours_from(ours), theirs_from(theirs)
        for step in range(12):
            generator = torch.Generator().manual_seed(step)
            for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                if (index + step) % 5 == 0:  # no gradient this step
                    a.grad = b.grad = None
                    continue
                grad = torch.randn(a.shape, generator=generator, dtype=dtype).to(device)
                a.grad, b.grad = grad.clone(), grad.clone()
            mine.step()
            torchs.step()
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            for key, value in torchs.state[b].items():
                torch.testing.assert_close(mine.state[a][key], value, rtol=1e-5, atol=1e-6)
        runs.append((ours, mine))
    (chunked, chunked_optimizer), (alone, alone_optimizer) = runs
    for a, b in zip(chunked, alone, strict=True):
        assert torch.equal(a, b)
        first, second = chunked_optimizer.state[a], alone_optimizer.state[b]
        assert first.keys() == second.keys()
        assert all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kahan", [False, True])
def test_bf16_weights_and_moments_round_to_a_neighbour_of_the_fp32_update(
    kahan: bool, device: str
) -> None:
    """Many bf16 tensors in one chunk (and a non-contiguous one, written on its own): after a
    step each weight and moment is one of the two bf16 neighbours of what fp32 AdamW computes
    from the same values, in its own place (a value scattered to another tensor or position
    would not be)."""
    _needs(device)
    ours = _mixed_weights(torch.bfloat16, device)
    reference = [torch.nn.Parameter(w.detach().float()) for w in ours]
    mine = StochasticAdamW(ours, lr=1e-2, kahan=kahan, seed=5)
    torchs = torch.optim.AdamW(reference, lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for a, b in zip(ours, reference, strict=True):
        grad = torch.randn(a.shape, generator=generator).to(device, torch.bfloat16)
        a.grad, b.grad = grad, grad.float()
    mine.step()
    torchs.step()
    pairs = [(a, b) for a, b in zip(ours, reference, strict=True)]
    pairs += [
        (mine.state[a][k], torchs.state[b][k]) for a, b in pairs for k in ("exp_avg", "exp_avg_sq")
    ]
    for rounded, exact in pairs:
        down = exact.detach().bfloat16().float()
        ulp = (down.abs() * 2**-7).clamp_min(2**-133)
        gap = (rounded.detach().float() - exact.detach()).abs()
        assert bool((gap <= ulp).all())
    if kahan:  # the compensation holds what the rounding left out of each weight
        for a, b in zip(ours, reference, strict=True):
            kept = a.detach().float() + mine.state[a]["compensation"].float()
            torch.testing.assert_close(kept, b.detach(), rtol=2**-14, atol=1e-7)


# the rounding noise of a bf16 shard is a DTensor random op; on a CPU mesh torch warns so
@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
def test_fsdp2_shards_are_updated_each_on_its_own(single_process_group: None) -> None:
    """FSDP2 (``fully_shard``) makes parameters DTensor shards, which have no concatenation
    or foreach copy that keeps them sharded: each is a chunk of its own, updated as torch's
    loop updates it (fp32 weights: torch's AdamW on the same model unsharded), and bf16
    shards train on as DTensors, with the optimizer built over the sharded parameters (not a
    route ``prepare()`` offers: it refuses a sharded model under pure bf16, and
    ``plan.step`` refuses an optimizer built before ``fully_shard``; tests/test_plan.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # a CPU mesh named: without one, on a machine with a GPU, FSDP2 builds its mesh on CUDA and
    # moves the shards there, away from the CPU reference (found by a review of the CUDA paths)
    mesh = init_device_mesh("cpu", (1,))

    def model(dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        return torch.nn.Sequential(*layers).to(dtype)

    def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            net(torch.randn(5, 8, generator=generator).to(dtype)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    sharded, plain = model(torch.float32), model(torch.float32)
    fully_shard(sharded, mesh=mesh)
    train(sharded, StochasticAdamW(sharded.parameters(), lr=1e-2), torch.float32)
    train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.float32)
    for ours, theirs in zip(sharded.parameters(), plain.parameters(), strict=True):
        assert type(ours).__name__ == "DTensor"
        torch.testing.assert_close(ours.full_tensor(), theirs.detach(), rtol=1e-5, atol=1e-6)
    bf16 = model(torch.bfloat16)
    start = [p.detach().clone() for p in bf16.parameters()]
    fully_shard(bf16, mesh=mesh)
    train(bf16, StochasticAdamW(bf16.parameters(), lr=1e-2, kahan=True), torch.bfloat16)
    for before, after in zip(start, bf16.parameters(), strict=True):
        assert after.dtype == torch.bfloat16 and type(after).__name__ == "DTensor"
        assert not torch.equal(after.full_tensor(), before)


def _replicas_worker(rank: int, port: int, mode: str, accumulate: bool, out: str) -> None:
    """One rank of a 2-process DDP run: seeded by rank (the usual ``manual_seed(base +
    rank)``), the plan's model wrapped in DDP; writes its weights for the parent to compare."""
    import warnings

    import torch.distributed as dist

    import autoprec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(1234 + rank)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = autoprec.prepare(
                autoprec.ModeSpec(mode=mode),
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-3),
                grad_accumulation_steps=2 if accumulate else 1,
            )
            ddp = torch.nn.parallel.DistributedDataParallel(plan.model)  # rank 0's weights
            generator = torch.Generator().manual_seed(100 + rank)
            for _ in range(10 if not accumulate else 20):
                x, y = (
                    torch.randn(8, 16, generator=generator),
                    torch.randn(8, 4, generator=generator),
                )
                with plan.autocast():
                    loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
                plan.step(loss)
        weights = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        gathered = [torch.zeros_like(weights) for _ in range(2)]
        dist.all_gather(gathered, weights)
        said = [str(w.message) for w in caught if "no_sync" in str(w.message)]
        if rank == 0:
            torch.save({"weights": gathered, "warned": said}, out)
        del ddp
        dist.barrier()  # both ranks done with gloo before either tears it down
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort an exiting interpreter ("terminate called without an active
    # exception", 1 run in 6): the results are saved, so leave without its teardown
    os._exit(0)


@pytest.mark.parametrize(("mode", "accumulate"), [("bf16_sr", False), ("bf16_pure", True)])
def test_ddp_replicas_round_alike_with_seeds_by_rank(
    mode: str, accumulate: bool, tmp_path: Path
) -> None:
    """Found by a hunt: the rounding stream was seeded from ``torch.initial_seed()``, which
    ``torch.manual_seed(base + rank)`` makes differ by rank, and bf16_sr's DDP replicas drifted
    apart from the first step (1067 of 1348 weights after 10 steps). In a process group it is
    seeded from the weights DDP made alike. Pure bf16 with accumulation warns that DDP's
    ``no_sync()`` would reduce the last micro-batch alone."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    result = tmp_path / "replicas.pt"
    mp.spawn(_replicas_worker, args=(port, mode, accumulate, str(result)), nprocs=2, join=True)
    saved = torch.load(result)
    first, second = saved["weights"]
    assert torch.equal(first, second), (first - second).abs().max()
    assert bool(saved["warned"]) == accumulate, saved["warned"]


def test_in_a_process_group_a_pinned_seed_rounds_and_a_resume_takes_the_saved_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review: in a process group the rounding stream seeds from the weights, alike
    in every trial, so tune's run seed no longer changed bf16_sr's noise (trials pin it now);
    and a DDP run resumed on cuda:r from rank 0's checkpoint (its cuda:0 stream) seeded a
    fresh stream by the device index, otherwise on every rank. Complex weights digest without
    torch's "discards the imaginary part" warning."""
    import torch.distributed as dist

    from autoprec.stochastic_optim import _saved_cuda_stream, pin_rounding_seed

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    weight = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    torch.manual_seed(1)
    first = StochasticAdamW([weight])._first_seed()
    torch.manual_seed(2)
    assert StochasticAdamW([weight])._first_seed() == first  # the weights', not the rank's
    pinned = StochasticAdamW([weight])
    pin_rounding_seed(pinned, 5)
    assert pinned._first_seed() == 5
    complex_weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StochasticAdamW([complex_weight])._first_seed()
    saved = {"cpu": torch.zeros(1), "cuda:0": torch.ones(1)}
    assert _saved_cuda_stream(saved, 3, [3]) is saved["cuda:0"]  # rank 3 resumes rank 0's
    assert _saved_cuda_stream(saved, 3, [2, 3]) is None  # two devices: which is whose?
    assert _saved_cuda_stream({**saved, "cuda:3": torch.full((1,), 3.0)}, 3, [3])[0] == 3.0
