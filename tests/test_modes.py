"""Every CPU-capable mode trains an example model 60 steps through a saved-and-loaded profile,
with falling loss, and does what it says: dtypes, optimizer, hyper-parameters, groups, scaler,
keep_fp32."""

from __future__ import annotations

import contextlib
import copy
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import autoprec
from autoprec.errors import OptimizerRebuiltWarning, UnsupportedModeError
from autoprec.layer_keep import FP8_SKIP_REASONS
from autoprec.layers import scan_model
from autoprec.modes.amp import AmpFp16Mode
from autoprec.plan import build_plan, prepare
from autoprec.specs import ModeSpec
from examples import tiny_gpt

SMALL = {"vocab_size": 128, "block_size": 32, "n_layer": 1, "n_embd": 64}
LR, BETAS, EPS = 3e-3, (0.8, 0.95), 1e-7  # deliberately not any library's defaults
DECAY, NO_DECAY = 0.1, 0.0


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable next-token task: token t+1 = (3 * token t + 1) mod vocab."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, SMALL["vocab_size"], (8, 1), generator=generator)
        sequence = [start]
        for _ in range(SMALL["block_size"]):
            sequence.append((sequence[-1] * 3 + 1) % SMALL["vocab_size"])
        tokens = torch.cat(sequence, dim=1)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def _nanogpt_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: decay for matrices, none for biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": NO_DECAY}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
    )


def train(spec: ModeSpec, tmp_path: Path, steps: int = 60):
    path = autoprec.profile_for(spec).save(tmp_path / f"{spec.label}.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a profile made here must load without a mismatch
        warnings.simplefilter("ignore", autoprec.UnprovenProfileWarning)  # profile_for's
        profile = autoprec.load_profile(path)
    model, _ = tiny_gpt.make_model(**SMALL)
    user_optimizer = _nanogpt_optimizer(model)
    # a constant schedule: every mode must keep driving the optimizer it steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(user_optimizer, lambda step: 1.0)
    plan = profile.apply(model, user_optimizer, scheduler)
    assert plan.scheduler is scheduler and scheduler.optimizer is plan.optimizer
    losses = []
    for tokens, targets in _batches(steps):
        with plan.autocast():
            loss = plan.model(tokens, targets)
        plan.step(loss)
        scheduler.step()
        losses.append(loss.item())
    return plan, user_optimizer, losses


def assert_learns(losses: list[float]) -> None:
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert last < 0.6 * first, f"loss {first:.3f} -> {last:.3f}"


def group_options(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def parameter_dtypes(model: torch.nn.Module) -> dict[str, torch.dtype]:
    return {name: p.dtype for name, p in model.named_parameters()}


def test_fp32(tmp_path: Path) -> None:
    plan, user_optimizer, losses = train(ModeSpec(mode="fp32"), tmp_path)
    assert_learns(losses)
    assert plan.optimizer is user_optimizer  # nothing to rebuild
    assert set(parameter_dtypes(plan.model).values()) == {torch.float32}
    assert plan.state_dict()["mode"] == {}


def test_amp_bf16(tmp_path: Path) -> None:
    plan, user_optimizer, losses = train(ModeSpec(mode="amp_bf16"), tmp_path)
    assert_learns(losses)
    assert plan.optimizer is user_optimizer
    assert set(parameter_dtypes(plan.model).values()) == {torch.float32}  # fp32 master weights
    tokens, _ = _batches(1)[0]
    with plan.autocast():
        assert plan.model(tokens).dtype == torch.bfloat16
    assert not hasattr(plan.mode, "scaler")


def test_amp_fp16_has_a_loss_scaler(tmp_path: Path) -> None:
    plan, _, losses = train(ModeSpec(mode="amp_fp16"), tmp_path)
    assert_learns(losses)
    assert isinstance(plan.mode, AmpFp16Mode)
    assert isinstance(plan.mode.scaler, torch.amp.GradScaler) and plan.mode.scaler.is_enabled()
    state = plan.state_dict()["mode"]
    assert state["scaler"]["scale"] == plan.mode.loss_scale and state["steps"] == 60
    tokens, _ = _batches(1)[0]
    with plan.autocast():
        assert plan.model(tokens).dtype == torch.float16


class _FlagOnDevice:
    """A 0-d inf flag on a named device that, like a CUDA tensor, adds only to one on its own
    device (two GPUs cannot be had on a CPU machine)."""

    def __init__(self, value: float, device: str) -> None:
        self.value, self.device = value, device

    def to(self, device: str, non_blocking: bool = False) -> _FlagOnDevice:
        return _FlagOnDevice(self.value, device)

    def __add__(self, other: _FlagOnDevice) -> _FlagOnDevice:
        assert self.device == other.device, f"{self.device} + {other.device}"
        return _FlagOnDevice(self.value + other.value, self.device)


def test_amp_fp16_combines_the_inf_flags_of_a_split_model_on_the_scales_device() -> None:
    """Found by a review of the CUDA paths: a model split over GPUs gives GradScaler one inf
    flag a device, and ``sum`` of a cuda:0 and a cuda:1 flag raised at the first step."""
    from autoprec.modes.amp import _combined_inf_flags

    flags = [
        _FlagOnDevice(1.0, "cuda:1"),
        _FlagOnDevice(0.0, "cuda:0"),
        _FlagOnDevice(1.0, "cuda:1"),
    ]
    combined = _combined_inf_flags(flags, "cuda:0")  # type: ignore[arg-type]
    assert (combined.device, combined.value) == ("cuda:0", 2.0)  # type: ignore[attr-defined]
    one = torch.tensor(1.0)
    assert _combined_inf_flags([one], torch.device("cpu")) is one  # no copy on one device
    assert _combined_inf_flags([one, torch.tensor(0.0)], torch.device("cpu")).item() == 1.0


def test_bf16_pure_keeps_the_users_optimizer_class(tmp_path: Path) -> None:
    plan, user_optimizer, losses = train(ModeSpec(mode="bf16_pure"), tmp_path)
    assert_learns(losses)
    assert plan.optimizer is user_optimizer
    assert set(parameter_dtypes(plan.model).values()) == {torch.bfloat16}
    state = plan.optimizer.state[next(plan.model.parameters())]
    assert state["exp_avg"].dtype == torch.bfloat16  # no fp32 copy anywhere


@pytest.mark.parametrize(("mode", "kahan"), [("bf16_sr", False), ("bf16_sr_kahan", True)])
def test_stochastic_rounding_modes(mode: str, kahan: bool, tmp_path: Path) -> None:
    plan, user_optimizer, losses = train(ModeSpec(mode=mode), tmp_path)
    assert_learns(losses)
    assert type(plan.optimizer).__name__ == "StochasticAdamW"
    options = group_options(plan.optimizer)
    assert [o["weight_decay"] for o in options] == [DECAY, NO_DECAY]
    assert all(o["lr"] == LR and o["betas"] == BETAS and o["eps"] == EPS for o in options)
    assert all(o["kahan"] is kahan and o["decoupled_weight_decay"] for o in options)
    assert [len(g["params"]) for g in plan.optimizer.param_groups] == [
        len(g["params"]) for g in user_optimizer.param_groups
    ]
    weight = plan.model.blocks[0].mlp[0].weight
    assert weight.dtype == torch.bfloat16
    assert ("compensation" in plan.optimizer.state[weight]) is kahan


def test_bf16_kahan_uses_optimi_with_the_users_hyperparameters(tmp_path: Path) -> None:
    plan, _, losses = train(ModeSpec(mode="bf16_kahan"), tmp_path)
    assert_learns(losses)
    import optimi

    # torch-optimi's AdamW, its weight decay through the Kahan compensation
    assert isinstance(plan.optimizer, optimi.AdamW)
    assert type(plan.optimizer).__name__ == "KahanDecayAdamW"
    for options, weight_decay in zip(group_options(plan.optimizer), (DECAY, NO_DECAY), strict=True):
        # torch-optimi's own defaults are betas (0.9, 0.99) and eps 1e-6: they must not leak in
        assert (options["beta1"], options["beta2"], options["eps"]) == (*BETAS, EPS)
        assert options["lr"] == LR and options["weight_decay"] == weight_decay
        assert options["kahan_sum"] is True
    assert set(parameter_dtypes(plan.model).values()) == {torch.bfloat16}


def test_fp8_torchao_emulated(tmp_path: Path) -> None:
    plan, user_optimizer, losses = train(
        ModeSpec(
            mode="fp8_torchao",
            emulate=True,
            keep_fp32=("blocks.0.attn.c_attn",),
            fp8_layers="all",
        ),
        tmp_path,
    )
    assert_learns(losses)
    kinds = {fqn: type(m).__name__ for fqn, m in plan.model.named_modules()}
    assert kinds["blocks.0.mlp.0"] == "Float8Linear"
    assert kinds["blocks.0.attn.c_proj"] == "Float8Linear"
    assert kinds["blocks.0.attn.c_attn"] == "Linear"  # kept in fp32
    assert set(parameter_dtypes(plan.model).values()) == {torch.float32}
    assert plan.optimizer is user_optimizer  # torchao swaps modules but keeps the Parameters


def test_fp8_torchao_rowwise_emulated(tmp_path: Path) -> None:
    plan, _, losses = train(
        ModeSpec(mode="fp8_torchao", emulate=True, fp8_recipe="torchao_rowwise", fp8_layers="all"),
        tmp_path,
    )
    assert_learns(losses)
    linear = plan.model.blocks[0].mlp[0]
    assert type(linear).__name__ == "Float8Linear"
    assert "rowwise" in str(linear.config).lower() or "AXISWISE" in str(linear.config)


def test_fp8_leaves_a_linear_whose_weight_is_computed_out_of_fp8() -> None:
    """torchao's swap raised a bare TypeError on a weight_norm / spectral_norm Linear, with the
    Linears before it already Float8Linear: the user's model was left half converted."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 32),
        parametrizations.weight_norm(nn.Linear(32, 32)),
        parametrizations.spectral_norm(nn.Linear(32, 32)),
        nn.Linear(32, 32),
    )
    layers = scan_model(model)  # the probe and the FP8 candidates' skip list agree
    assert [linear.fp8_compatible for linear in layers.linears] == [True, False, False, True]
    reasons = {keep.fqn: keep.reason for keep in layers.keep_fp32}
    assert reasons["1"].startswith("Linear with a computed weight (weight_norm")
    assert {"1", "2"} <= set(layers.kept_for(FP8_SKIP_REASONS))
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    kinds = [type(module).__name__ for module in plan.model]
    assert kinds == ["Float8Linear", "ParametrizedLinear", "ParametrizedLinear", "Float8Linear"]
    with plan.autocast():
        loss = plan.model(torch.randn(4, 32)).float().pow(2).mean()
    plan.step(loss)
    assert torch.isfinite(loss)


class _LoRALinear(nn.Linear):
    """loralib's pattern: adapters beside the weight, and a forward of its own."""

    def __init__(self, features: int) -> None:
        super().__init__(features, features)
        self.lora_a = nn.Parameter(torch.randn(4, features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(features, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


class _ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 10.0


def test_fp8_leaves_linears_a_swap_would_change_out_of_fp8() -> None:
    """Found by a hunt: torchao's swap keeps weight and bias and runs nn.Linear's forward. A
    LoRA Linear failed with the user's model half converted; a subclass scaling its output by
    10 trained unscaled (relative output error 0.89), and a hooked Linear lost its hooks."""
    torch.manual_seed(0)
    hooked = nn.Linear(32, 32)
    calls: list[int] = []
    hooked.register_forward_hook(lambda module, args, out: calls.append(1))
    model = nn.Sequential(
        nn.Linear(32, 32), _LoRALinear(32), _ScaledLinear(32, 32), hooked, nn.Linear(32, 32)
    )
    reasons = {keep.fqn: keep.reason for keep in scan_model(model).keep_fp32}
    assert reasons["1"] == (
        "an FP8 module swap would drop what this Linear has of its own: _LoRALinear has its "
        "own forward"
    )
    assert reasons["3"].endswith("of its own: forward hooks are registered on it")
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = model(x)
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert plan.mode.fp8_modules(plan.model) == ("0", "4")
    calls.clear()
    with torch.no_grad(), plan.autocast():
        out = plan.model(x).float()
    assert calls == [1]
    assert float((out - expected).norm() / expected.norm()) < 0.05  # FP8 error, not x10


def test_fp8_refuses_a_model_it_would_convert_nothing_of() -> None:
    """A root Linear (torchao returns a new module for it, which was dropped) or a model whose
    Linears all stay out: it trained as bf16 autocast labelled FP8, without a word."""
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    root = nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"would run no layer of Linear in FP8.*use amp_bf16"):
        prepare(spec, root, torch.optim.AdamW(root.parameters(), lr=1e-3))
    subclass = nn.Sequential(_ScaledLinear(64, 64))
    with pytest.raises(
        UnsupportedModeError,
        match=r"1 with a forward, methods, tensors, attributes or hooks of its",
    ):
        prepare(spec, subclass, torch.optim.AdamW(subclass.parameters(), lr=1e-3))
    assert type(subclass[0]) is _ScaledLinear


def test_fp8_says_when_its_size_rule_left_out_every_fitting_linear() -> None:
    """Found by a hunt: a model of small plain Linears, all divisible by 16, was refused under
    the default fp8_layers="worthwhile" for not fitting FP8 kernels, which they do."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    spec = ModeSpec(mode="fp8_torchao", emulate=True)
    with pytest.raises(ValueError, match=r"Linears that fit FP8 kernels \(0, 2\) are all too sm"):
        prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert isinstance(model[0], nn.Linear) and model[0].weight.dtype == torch.float32
    everything = spec.model_copy(update={"fp8_layers": "all"})  # what the refusal advises
    plan = prepare(everything, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert plan.mode.fp8_modules(plan.model) == ("0", "2")
    shared = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    shared.skipped = nn.Sequential(shared[2])  # "2" is skipped under its second name
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_skip=("skipped",))
    with pytest.raises(ValueError, match=r"Linears that fit FP8 kernels \(0\) are all too sm"):
        prepare(spec, shared, torch.optim.AdamW(shared.parameters(), lr=1e-3))


def test_fp32_islands_under_a_fullgraph_compile_are_refused_up_front() -> None:
    """Found by a hunt: apply() on torch.compile(model, fullgraph=True) with keep_fp32 failed
    at the first forward inside dynamo, hinting to remove autoprec's own
    torch.compiler.disable; tune's trials (compiled without fullgraph) had accepted it."""

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))

    kept = ModeSpec(mode="amp_bf16", keep_fp32=("1",))
    wrapped = torch.compile(model(), fullgraph=True)
    with pytest.raises(ValueError, match=r"keeps 1 in fp32 .* fullgraph=True"):
        prepare(kept, wrapped, torch.optim.AdamW(wrapped.parameters()))
    assert not hasattr(wrapped._orig_mod, "_autoprec_converted_for")  # nothing converted
    for spec, fullgraph in ((kept, False), (ModeSpec(mode="amp_bf16"), True)):
        wrapper = torch.compile(model(), fullgraph=fullgraph)
        prepare(spec, wrapper, torch.optim.AdamW(wrapper.parameters()))


@pytest.mark.parametrize("where", ["model", "kept module", "its parent"])
def test_fp32_islands_under_an_in_place_fullgraph_compile_are_refused_up_front(where: str) -> None:
    # model.compile(fullgraph=True) was not read: apply() converted the model and its first
    # forward failed inside dynamo, naming autoprec's own hook (found by a hunt)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8)))
    {"model": model, "kept module": model[1][0], "its parent": model[1]}[where].compile(
        fullgraph=True
    )
    kept = ModeSpec(mode="amp_bf16", keep_fp32=("1.0",))
    with pytest.raises(ValueError, match=r"keeps 1\.0 in fp32 .* compiled with fullgraph=True"):
        prepare(kept, model, torch.optim.AdamW(model.parameters()))
    assert not hasattr(model, "_autoprec_converted_for")  # nothing converted
    model[0].compile(fullgraph=True)  # a module holding nothing kept: no island inside it
    loose = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8)))
    loose.compile()
    prepare(kept, loose, torch.optim.AdamW(loose.parameters()))


# dynamo reads .grad of the non-leaf tensors a graph break hands to the resumed frame
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("mode", ["amp_bf16", "bf16_sr"])
def test_a_kept_module_wrapped_in_torch_compile_stays_fp32_when_the_model_compiles(
    mode: str,
) -> None:
    # dynamo inlines the wrapper of head = torch.compile(head) and skips its hooks: the kept
    # head computed in bf16 under AMP, unsaid, and failed under pure bf16 (found by a hunt)
    from examples import raw_param_mlp

    model, _ = raw_param_mlp.make_model()
    model.head = torch.compile(model.head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        spec = ModeSpec(mode=mode, keep_fp32=("head",), compile=True)
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    seen: list[tuple[torch.dtype, bool]] = []  # after autoprec's hooks: what the forward sees
    model.head._orig_mod.register_forward_pre_hook(
        lambda m, args: seen.append((args[0].dtype, torch.is_autocast_enabled("cpu")))
    )
    inputs, _ = raw_param_mlp.make_batches(count=1)[0]
    with plan.autocast():
        plan.model(inputs)
    assert seen == [(torch.float32, False)]  # an fp32 island: fp32 input, autocast off


@pytest.mark.parametrize("mode", ["fp32", "amp_bf16", "bf16_pure"])
def test_8bit_optimizer_states(mode: str, tmp_path: Path) -> None:
    plan, _, losses = train(ModeSpec(mode=mode, optimizer_bits=8), tmp_path)
    assert_learns(losses)
    assert type(plan.optimizer).__name__ == "AdamW8bit"
    options = group_options(plan.optimizer)
    assert [o["weight_decay"] for o in options] == [DECAY, NO_DECAY]
    assert all(o["lr"] == LR and o["betas"] == BETAS and o["eps"] == EPS for o in options)
    big = plan.model.blocks[0].mlp[0].weight  # 64 x 256 = 16384 elements: quantized
    assert plan.optimizer.state[big]["state1"].dtype == torch.uint8
    small = plan.model.blocks[0].mlp[0].bias  # 256 elements: bitsandbytes keeps it 32-bit
    assert plan.optimizer.state[small]["state1"].dtype == torch.float32


@pytest.mark.parametrize("mode", ["amp_bf16", "bf16_pure", "bf16_kahan"])
def test_keep_fp32_modules_really_run_in_fp32(mode: str, tmp_path: Path) -> None:
    spec = ModeSpec(mode=mode, keep_fp32=("wte", "ln_f", "blocks.*.ln_*"))
    plan, _, losses = train(spec, tmp_path, steps=60)
    assert_learns(losses)
    dtypes = parameter_dtypes(plan.model)
    # wte is tied to lm_head: the shared weight stays fp32
    for name in ("wte.weight", "ln_f.weight", "blocks.0.ln_1.weight", "blocks.0.ln_2.bias"):
        assert dtypes[name] == torch.float32, name
    low = torch.float32 if mode == "amp_bf16" else torch.bfloat16
    assert dtypes["blocks.0.mlp.0.weight"] == low
    inside: dict[str, tuple[torch.dtype, bool]] = {}
    for name in ("ln_f", "lm_head", "blocks.0.mlp.0"):
        # registered after autoprec's hooks: sees what the module's forward will see
        plan.model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: inside.__setitem__(
                name, (args[0].dtype, torch.is_autocast_enabled("cpu"))
            )
        )
    tokens, _ = _batches(1)[0]
    with plan.autocast():
        logits = plan.model(tokens)
    assert inside["ln_f"] == (torch.float32, False)  # fp32 input, no autocast: an fp32 island
    # tied to the kept wte, not kept itself: it computes in bf16 (pure bf16: from the fp32
    # weight, under autocast)
    assert inside["lm_head"] == (
        (torch.float32, True) if mode == "amp_bf16" else (torch.bfloat16, True)
    )
    assert inside["blocks.0.mlp.0"] == (
        (torch.float32, True) if mode == "amp_bf16" else (torch.bfloat16, False)
    )
    assert logits.dtype == torch.bfloat16


class _Stacked(nn.Module):
    """Blocks in a ModuleList (never called: its children are), attention, a ParameterList."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(32))])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        x = self.attention(x, x, x)[0]
        return self.head(x.mean(1) * self.scales[0])


@pytest.mark.parametrize("mode", ["amp_bf16", "bf16_sr"])
def test_keep_fp32_of_a_module_list_keeps_the_blocks_in_it(mode: str) -> None:
    # the list's hooks never fire: its blocks computed in bf16 under AMP, unsaid, and failed
    # under pure bf16 ("mat1 and mat2 must have the same dtype"; found by a hunt)
    model = _Stacked()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        spec = ModeSpec(mode=mode, keep_fp32=("blocks",))
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    inside: dict[str, tuple[torch.dtype, bool]] = {}
    for name in ("blocks.0", "blocks.1"):  # after autoprec's hooks: what the forward sees
        plan.model.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: inside.__setitem__(
                name, (args[0].dtype, torch.is_autocast_enabled("cpu"))
            )
        )
    with plan.autocast():
        loss = plan.model(torch.randn(2, 5, 32)).float().pow(2).mean()
    plan.step(loss)
    assert inside == {"blocks.0": (torch.float32, False), "blocks.1": (torch.float32, False)}
    assert {p.dtype for p in plan.model.blocks.parameters()} == {torch.float32}
    assert plan.model.head.weight.dtype == (torch.float32 if mode == "amp_bf16" else torch.bfloat16)


@pytest.mark.parametrize("kept", ["attention.out_proj", "scales"])
def test_keep_fp32_refuses_a_module_its_owner_never_calls(kept: str) -> None:
    # an island hooks the module's calls: keeping one of these kept nothing under AMP, unsaid
    model = _Stacked()
    owner = "Keep its owner 'attention'" if kept == "attention.out_proj" else "root module"
    with pytest.raises(ValueError, match=f"keeps '{kept}' apart from its owner.*{owner}"):
        prepare(
            ModeSpec(mode="amp_bf16", keep_fp32=(kept,)),
            model,
            torch.optim.AdamW(model.parameters()),
        )
    batches = [(torch.randn(2, 5, 32), torch.randn(2, 4)) for _ in range(8)]
    with pytest.raises(ValueError, match=f"keeps '{kept}' apart from its owner"):
        autoprec.check(model, batches, steps=2, loss_fn=nn.functional.mse_loss, keep_fp32=[kept])
    assert autoprec.prepare(  # kept whole, the owner's own calls run in fp32
        ModeSpec(mode="amp_bf16", keep_fp32=("attention",)),
        model,
        torch.optim.AdamW(model.parameters()),
    )


def test_fp8_swaps_a_linear_registered_twice_under_both_names() -> None:
    # torchao's swap walks named_modules(), each module once: the second name kept the plain
    # Linear, half the calls in FP8 and half in bf16, the user's one module split (a hunt)
    pytest.importorskip("torchao")

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.a, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
            self.b = self.a

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.b(torch.relu(self.a(torch.relu(self.inp(x))))))

    model = Shared()
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all", fp8_skip=("inp", "out"))
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    assert model.a is model.b and type(model.a).__name__ == "Float8Linear"
    assert type(model.inp) is nn.Linear
    weight = model.a.weight.detach().clone()
    with plan.autocast():
        loss = plan.model(torch.randn(4, 16)).float().pow(2).mean()
    plan.step(loss)
    assert not torch.equal(weight, model.b.weight)


class _SharedAcross(nn.Module):
    """One Linear registered as ``enc.1`` (its first name) and ``dec.0``."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(64, 64)
        self.enc = nn.Sequential(nn.Linear(32, 64), shared)
        self.dec = nn.Sequential(shared, nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


def test_fp8_swaps_a_linear_registered_under_two_parents_into_one_module() -> None:
    """Found by a hunt: torchao's swap walks each parent's children, so a Linear registered
    as ``enc.1`` and ``dec.0`` became two Float8Linears (weights shared): a hook put on one
    after conversion never fired, the forward calling the other."""
    pytest.importorskip("torchao")
    model = _SharedAcross()
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    assert type(model.dec[0]).__name__ == "Float8Linear" and model.dec[0] is model.enc[1]
    called: list[int] = []
    model.enc[1].register_forward_hook(lambda *args: called.append(1))
    with plan.autocast():
        plan.model(torch.randn(4, 32))
    assert called == [1, 1]  # both calls: one module


def test_an_fp8_swap_keeps_out_a_linear_whose_hooks_methods_or_attributes_it_would_drop() -> None:
    """Found by a hunt: the swap check read a Linear's forward and forward hooks only; a
    backward or state-dict hook, a method of its own (``_load_from_state_dict`` remapping a
    key) or a forward set on the instance was dropped by the swap without a word. Methods no
    step calls (``reset_parameters``, ``extra_repr``) and attributes (carried onto the
    replacement) do not keep a Linear out."""
    from autoprec.layer_kinds import swap_would_drop

    def linear() -> nn.Linear:
        return nn.Linear(32, 32)

    backward = linear()
    backward.register_full_backward_hook(lambda *args: None)
    saving = linear()
    saving.register_state_dict_post_hook(lambda *args: None)

    class Remap(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super()._load_from_state_dict(*args, **kwargs)

    class Initialised(nn.Linear):
        def reset_parameters(self) -> None:
            nn.init.zeros_(self.weight)

    patched = linear()
    patched.forward = lambda x: x  # type: ignore[method-assign]
    plain = linear()
    plain._is_hf_initialized = True  # type: ignore[attr-defined]
    assert swap_would_drop(backward) == "backward_hooks are registered on it"
    assert swap_would_drop(saving) == "state_dict_hooks are registered on it"
    assert swap_would_drop(Remap(32, 32)) == "Remap defines _load_from_state_dict"
    assert swap_would_drop(patched) == (
        "its forward is set on the instance (an accelerate or PEFT hook?)"
    )
    assert swap_would_drop(Initialised(32, 32)) is None
    assert swap_would_drop(plain) is None
    marked = linear()
    marked.NANOGPT_SCALE_INIT = 1  # type: ignore[attr-defined]  # read at init: not kept out
    assert swap_would_drop(marked) is None
    configured = linear()
    configured.config = {"user": 1}  # type: ignore[attr-defined]  # Float8Linear sets its own
    assert swap_would_drop(configured) == (
        "its attributes config are names the FP8 module sets itself"
    )
    model = nn.Sequential(marked, nn.ReLU(), backward, nn.ReLU(), linear())
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    assert plan.mode.fp8_modules(model) == ("0", "4") and model[2] is backward
    assert model[0].NANOGPT_SCALE_INIT == 1  # carried onto the Float8Linear (a review)


def test_a_model_already_converted_to_fp8_is_refused_saying_so() -> None:
    """Found by a hunt: a model the user converted with torchao was refused for Linears "with
    a forward, tensors or hooks of its own (a LoRA Linear)"."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    with pytest.raises(UnsupportedModeError, match=r"2 already converted to FP8 \(torchao"):
        prepare(spec, model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("field", ["keep_fp32", "fp8_skip"])
def test_fp8_leaves_a_linear_kept_under_its_second_name_out_of_fp8(field: str) -> None:
    """Found by a hunt: the FP8 filter read a module's first name only, so a Linear shared by
    ``enc`` and a kept (or skipped) ``dec`` ran in FP8 inside ``dec``: 0.03 from fp32 where
    keep_fp32 promises fp32, and the plan's FP8 layers under-reported."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = _SharedAcross()
    reference = copy.deepcopy(model)
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all", **{field: ("dec",)})
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    assert type(model.dec[0]) is nn.Linear and model.dec[0] is model.enc[1]
    assert plan.mode.fp8_modules(model) == ("enc.0",)
    hidden = torch.randn(8, 64)
    with torch.no_grad(), plan.autocast():
        kept = plan.model.dec(hidden)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if field == "fp8_skip":  # out of FP8, in bf16 autocast
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        expected = reference.dec(hidden)
    assert torch.equal(kept.float(), expected.float())


def test_user_model_is_converted_in_place_and_returned(tmp_path: Path) -> None:
    model, _ = tiny_gpt.make_model(**SMALL)
    plan = autoprec.prepare(
        ModeSpec(mode="bf16_pure"), model, torch.optim.AdamW(model.parameters())
    )
    assert plan.model is model


def test_pure_bf16_casts_fp32_tensors_made_inside_forward() -> None:
    """A timestep embedding computed in fp32 inside forward meets bf16 weights."""
    from examples import flow_unet

    model, (x, t) = flow_unet.make_model()
    plan = autoprec.prepare(
        ModeSpec(mode="bf16_pure"), model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    )
    output = plan.model(x, t)
    assert output.dtype == torch.bfloat16
    flow_unet.loss_fn(output, torch.zeros_like(x)).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_fp8_torchao_converts_only_layers_large_enough_by_default() -> None:
    """torchao's tensorwise size rule: K <= 4096 and N <= 1024 stays out of FP8 (in bf16
    autocast); "all" converts every Linear FP8 kernels take. The trial says which ran in FP8."""
    from torch import nn

    from autoprec.recipe import TrainingRecipe
    from autoprec.trial import run_trial

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2048), nn.Linear(2048, 16))
    batches = [(torch.randn(4, 64), torch.randn(4, 16)) for _ in range(2)]
    recipe = TrainingRecipe(
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss_fn=lambda out, target: nn.functional.mse_loss(out.float(), target),
    )
    converted = {}
    for layers in ("worthwhile", "all"):
        spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers=layers)
        record = run_trial(spec, model, batches, recipe=recipe, steps=2).record
        assert record.completed, record.failure
        converted[layers] = record.fp8_layers
    assert converted["worthwhile"] == ("2",)  # 64 -> 2048: N > 1024 pays; the rest do not
    assert converted["all"] == ("0", "2", "3")
    assert ModeSpec(mode="fp8_torchao").fp8_layers == "worthwhile"
    with pytest.raises(ValueError, match="fp8_layers applies only"):
        ModeSpec(mode="amp_bf16", fp8_layers="all")


class _TiedLm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(64, 32)
        self.hidden = nn.Linear(32, 32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.hidden(self.wte(tokens))))


def test_fp8_te_swap_keeps_ties_and_the_optimizers_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stand-in for transformer_engine.pytorch.Linear (same constructor): the swap must
    hand it the module's own Parameters, so a tied lm_head stays tied to wte and the user's
    optimizer still steps every weight the model trains."""
    from autoprec.modes import fp8_te
    from autoprec.optim import named_groups

    class StandInTeLinear(nn.Linear):
        def __init__(self, i: int, o: int, bias: bool, params_dtype: torch.dtype, device: object):
            super().__init__(i, o, bias=bias, dtype=params_dtype, device=device)

    stand_in = types.SimpleNamespace(pytorch=types.SimpleNamespace(Linear=StandInTeLinear))
    monkeypatch.setattr(fp8_te, "require", lambda name: stand_in)
    model = _TiedLm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mode = fp8_te.Fp8TeMode(ModeSpec(mode="fp8_te", fp8_skip=("hidden",)))
    groups = named_groups(optimizer, model)
    converted = mode.convert_module(model)
    assert isinstance(converted.lm_head, StandInTeLinear)
    assert not isinstance(converted.hidden, StandInTeLinear)  # fp8_skip: left as it was
    assert converted.lm_head.weight is converted.wte.weight
    assert mode.convert_optimizer(optimizer, converted, groups) is optimizer
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in converted.parameters()} <= held


def test_a_head_tied_to_a_kept_embedding_computes_in_bf16(tmp_path: Path) -> None:
    """Pure bf16 with wte kept in fp32: the tied lm_head keeps the shared fp32 weight but
    computes in bf16 from it (not an fp32 island: it is 39% of a small GPT's FLOPs)."""
    model = _TiedLm()
    plan = build_plan(
        ModeSpec(mode="bf16_kahan", keep_fp32=("wte",)),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
    )
    assert plan.model.lm_head.weight is plan.model.wte.weight
    assert plan.model.wte.weight.dtype == torch.float32
    assert plan.model.hidden.weight.dtype == torch.bfloat16
    seen = {}
    plan.model.lm_head.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out.dtype))
    tokens = torch.randint(0, 64, (4, 8))
    with plan.autocast():
        logits = plan.model(tokens)
    assert seen["out"] == torch.bfloat16 and logits.dtype == torch.bfloat16
    plan.step(logits.float().logsumexp(-1).mean())
    assert plan.model.wte.weight.dtype == torch.float32  # trained, still fp32 and tied
    assert plan.model.lm_head.weight is plan.model.wte.weight


def test_layers_kept_out_of_fp8_compute_in_bf16_and_keep_fp32_in_fp32() -> None:
    """fp8_skip and keep_fp32 are two things: a layer kept out of FP8 runs in the mode's bf16
    autocast (as torchtitan and Accelerate run it), a keep_fp32 layer in fp32."""
    model, tokens = tiny_gpt.make_model(**SMALL)
    spec = ModeSpec(
        mode="fp8_torchao",
        emulate=True,
        fp8_layers="all",
        fp8_skip=("lm_head",),
        keep_fp32=("blocks.0.attn.c_proj",),
    )
    plan = build_plan(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    kinds = {fqn: type(m).__name__ for fqn, m in plan.model.named_modules()}
    assert kinds["blocks.0.mlp.0"] == "Float8Linear"
    assert kinds["lm_head"] == kinds["blocks.0.attn.c_proj"] == "Linear"
    outputs: dict[str, torch.dtype] = {}
    for name in ("lm_head", "blocks.0.attn.c_proj"):
        plan.model.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: outputs.__setitem__(name, out.dtype)
        )
    with plan.autocast():
        plan.model(tokens)
    assert outputs == {"lm_head": torch.bfloat16, "blocks.0.attn.c_proj": torch.float32}


@pytest.mark.parametrize("field", ["keep_fp32", "fp8_skip"])
def test_a_glob_naming_a_container_keeps_its_linears_out_of_fp8(field: str) -> None:
    """``blocks.*.mlp`` keeps every Linear inside each block's MLP out of FP8, as the exact
    ``blocks.0.mlp`` does (the glob was matched against the Linears' own names only, so they
    ran FP8 matmuls inside the kept container)."""
    model, _ = tiny_gpt.make_model(**SMALL)
    spec = ModeSpec(
        mode="fp8_torchao", emulate=True, fp8_layers="all", **{field: ("blocks.*.mlp",)}
    )
    plan = build_plan(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    converted = plan.mode.fp8_modules(plan.model)
    assert converted and not any(fqn.startswith("blocks.0.mlp.") for fqn in converted)
    assert any(fqn.startswith("blocks.0.attn.") for fqn in converted)


def test_fp8_leaves_multihead_attentions_out_projection_alone() -> None:
    """nn.MultiheadAttention never calls its out_proj (it multiplies the weight itself): a
    Float8Linear there ran no FP8 matmul yet was listed among the layers the trial ran in FP8."""
    from tests.conftest import AttentionNet

    model = AttentionNet()
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    plan = build_plan(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert plan.mode.fp8_modules(plan.model) == ("inp", "out")
    loss = plan.model(torch.randn(2, 8, 64)).square().mean()
    loss.backward()


def test_fp8_candidates_keep_first_and_last_layers_out_of_fp8_not_in_fp32() -> None:
    from autoprec.candidates import screen_specs
    from autoprec.eligibility import Situation
    from autoprec.probing import probe

    model, tokens = tiny_gpt.make_model(**SMALL)
    report = probe(model, tokens)
    situation = Situation(
        hardware=report.hardware, device=report.device, layers=report.layers,
        backends=report.backends,
    )  # fmt: skip
    fp8 = next(s for s in screen_specs(report, situation).specs if s.mode == "fp8_torchao")
    assert fp8.keep_fp32 == ()
    assert "lm_head" in fp8.fp8_skip and "blocks.0.attn.c_attn" in fp8.fp8_skip


class _TiedHead(torch.nn.Module):
    """An embedding kept in fp32 and a head tied to it: pure bf16 runs the head in an
    autocast island (install_autocast_islands) and the embedding in an fp32 one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 32)
        self.mix = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(tokens))))


# dynamo reads .grad of the non-leaf tensors a graph break hands to the resumed frame
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_pure_bf16_islands_train_under_torch_compile() -> None:
    """Found on the first GPU run: a compiled pure-bf16 model whose head is tied to a kept
    embedding failed ("'autocast' object has no attribute 'prev'": dynamo traced the autocast
    entered in one hook and left in another). The island hooks now run eagerly; compiled and
    eager training agree."""
    tokens = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(0))
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _TiedHead()
        spec = ModeSpec(mode="bf16_pure", keep_fp32=("embed",), compile=compiled)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizerRebuiltWarning)
            plan = prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses[compiled] = []
        for _ in range(3):
            with plan.autocast():
                logits = plan.model(tokens)
                loss = torch.nn.functional.cross_entropy(
                    logits.float().flatten(0, 1), tokens.flatten()
                )
            plan.step(loss)
            losses[compiled].append(float(loss.detach()))
        assert plan.model.head.weight.dtype == torch.float32  # the kept embedding's weight
        assert plan.model.mix.weight.dtype == torch.bfloat16
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert losses[True][-1] < losses[True][0]


@pytest.mark.parametrize(("mode", "kept"), [("bf16_pure", "head"), ("amp_bf16", "embed")])
def test_an_error_inside_an_island_leaves_autocast_as_it_was(mode: str, kept: str) -> None:
    """An island's autocast was entered in a pre-hook and left in a forward hook, which torch
    skips when the forward raises: after a caught error (a token id out of range) bf16 autocast
    stayed on for the whole process (the embedding tied to a kept head), or off inside the
    user's own autocast (a kept embedding under amp_bf16)."""
    torch.manual_seed(0)
    model = _TiedHead()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(
            ModeSpec(mode=mode, keep_fp32=(kept,)), model, torch.optim.AdamW(model.parameters())
        )
    with plan.autocast():
        enabled = torch.is_autocast_enabled("cpu")
        with pytest.raises(IndexError):
            plan.model(torch.tensor([[3, 99]]))  # 99: beyond the embedding's 16 rows
        assert torch.is_autocast_enabled("cpu") is enabled
        assert plan.model(torch.tensor([[3, 5]])).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    assert nn.Linear(8, 8)(torch.randn(2, 8)).dtype == torch.float32


class _Standardised(nn.Module):
    """A running standardiser handed the model's input directly, and one handed a slice of it."""

    def __init__(self) -> None:
        super().__init__()
        from examples.running_stats import RunningStandardizer

        self.norm = RunningStandardizer(4, momentum=0.5)
        self.sliced = RunningStandardizer(2, momentum=0.5)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.norm(x), self.sliced(x[:, :2])], dim=1))


# dynamo reads .grad of the non-leaf tensors a graph break hands to the resumed frame
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("compiled", ["eager", "profile", "user"])
def test_a_kept_module_handed_a_model_input_reads_it_in_fp32(compiled: str) -> None:
    # inputs like a year (2020 +- 3): bf16's step there is 8, so a standardiser kept in fp32
    # but handed the bf16 cast saw 2016 or 2024 (its mean 0.25 off fp32's after one batch)
    from autoprec.modes import root_inputs

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * 3 + 2020
    torch.manual_seed(0)
    reference = _Standardised()
    reference(x)
    torch.manual_seed(0)
    model = _Standardised()
    spec = ModeSpec(mode="bf16_sr", keep_fp32=("norm", "sliced"), compile=compiled == "profile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    # "user": torch.compile(plan.model) after apply(), the root's hooks included
    run = torch.compile(plan.model) if compiled == "user" else plan.model
    out = run(x)
    assert out.dtype == torch.bfloat16 and model.head.weight.dtype == torch.bfloat16
    tolerance = 0.0 if compiled == "eager" else 1e-7 * 2020  # inductor may reduce otherwise
    assert (model.norm.mean - reference.norm.mean).abs().max() <= tolerance
    # a slice of the input: the same slice of the fp32 original (it arrived bf16-rounded)
    assert (model.sliced.mean - reference.sliced.mean).abs().max() <= tolerance
    out.float().sum().backward()
    assert model.head.weight.grad is not None
    copied = copy.deepcopy(plan.model)  # a copy's calls find their own inputs
    copied(x)
    reference(x)
    assert (copied.norm.mean - reference.norm.mean).abs().max() <= 2 * tolerance
    with pytest.raises(RuntimeError):
        plan.model(torch.zeros(3, 5))  # a forward that raises leaves no record behind
    assert root_inputs._stack() == []


@pytest.mark.filterwarnings("ignore::autoprec.errors.OptimizerRebuiltWarning")
@pytest.mark.parametrize("mode", ["bf16_pure", "bf16_sr", "amp_bf16"])
def test_a_module_shared_with_a_kept_container_computes_in_fp32_inside_it(mode: str) -> None:
    """Found by a hunt: one Linear registered as ``enc.0`` and ``dec.1``, ``dec`` kept. Pure
    bf16 took it for a module tied to a kept one (named_modules lists it once, as enc.0) and
    ran it under bf16 autocast inside dec's fp32 island too."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Sequential(nn.Linear(8, 8))
            self.dec = nn.Sequential(nn.LayerNorm(8), self.enc[0])
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.dec(self.enc(x)))

    model = Shared()
    seen: list[torch.dtype] = []
    model.dec[1].register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    spec = ModeSpec(mode=mode, keep_fp32=("dec",))
    plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    with plan.autocast():
        plan.model(torch.randn(2, 8)).float().sum().backward()
    assert seen == [torch.bfloat16, torch.float32]  # via enc, via the kept dec


class _Shifted(nn.Module):
    """A learned shift first in the model (an observation normaliser), then a small body."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.full((4,), -20.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


@pytest.mark.parametrize("slice_input", [False, True])
def test_a_checkpointed_kept_module_recomputes_from_the_fp32_input(slice_input: bool) -> None:
    """Found by a hunt: activation checkpointing recomputes the forward in the backward pass,
    after the call's record of fp32 originals is gone: the kept module recomputed from the
    bf16-rounded input (a mean of 20: a step of 0.125), and the gradients came out 78% off
    the same model's without checkpointing, with the loss unchanged."""
    from torch.utils.checkpoint import checkpoint

    x = 20 + 0.05 * torch.randn(16, 6, generator=torch.Generator().manual_seed(0))

    class Model(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.checkpointed = checkpointed
            self.body = nn.Sequential(_Shifted(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            inputs = inputs[:, 1:5] if slice_input else inputs[:, :4].contiguous()
            if self.checkpointed:
                return checkpoint(self.body, inputs, use_reentrant=False)
            return self.body(inputs)

    gradients = []
    for checkpointed in (False, True):
        torch.manual_seed(1)
        model = Model(checkpointed)
        spec = ModeSpec(mode="bf16_pure", keep_fp32=("body.0",))
        plan = prepare(spec, model, torch.optim.SGD(model.parameters(), lr=0.0))
        plan.backward(plan.model(x).float().pow(2).mean())
        gradients.append(model.body[1].weight.grad.float().clone())
    assert torch.equal(gradients[0], gradients[1])


@pytest.mark.filterwarnings("ignore::autoprec.errors.OptimizerRebuiltWarning")
def test_a_kept_module_reads_an_input_the_forward_edited_in_place_as_edited() -> None:
    """The root cast's record pointed a kept norm at the unedited fp32 original: it saw column
    0 as the random input where the model had set it to 100."""

    class EditsItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x[:, 0] = 100.0
            return self.head(self.norm(x))

    model = EditsItsInput()
    plan = autoprec.prepare(
        ModeSpec(mode="bf16_pure", keep_fp32=("norm",)),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
    )
    seen: list[torch.Tensor] = []
    model.norm.register_forward_hook(lambda _module, args, _output: seen.append(args[0]))
    plan.model(torch.randn(2, 4))
    assert seen[0][:, 0].tolist() == [100.0, 100.0]
    # inference mode keeps no version counter: the first version of this check raised there
    # (Lightning validates under it)
    with torch.inference_mode():
        plan.model(torch.randn(2, 4))
    assert seen[1][:, 0].tolist() == [100.0, 100.0]


def test_a_view_of_a_cast_input_is_read_from_the_same_view_of_the_original() -> None:
    from autoprec.modes.root_inputs import RootCast, original_input

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0)) * 3 + 2020
    expanded = (torch.randn(6, 1) + 2020).expand(6, 4)  # overlapping: its cast is laid out afresh
    root = RootCast(None)
    (low, low_expanded), _ = root.cast(nn.Linear(1, 1), (x, expanded), {})
    try:
        assert torch.equal(original_input(low[:, 1:3]), x[:, 1:3])
        assert torch.equal(original_input(low.t()[2]), x[:, 2])
        assert torch.equal(original_input(low.reshape(24)[5:9]), x.reshape(24)[5:9])
        assert original_input(low.sum(0)).dtype == torch.bfloat16  # computed: not an input
        assert low_expanded.stride() != expanded.stride()
        assert original_input(low_expanded[:, 1]).dtype == torch.bfloat16
        assert original_input(low_expanded) is expanded
    finally:
        root.forget(nn.Linear(1, 1), (), None)
    # the call is over: found while the cast input lives (a checkpoint's recompute), then gone
    assert torch.equal(original_input(low[:, 1:3]), x[:, 1:3])
    from autoprec.modes import root_inputs

    held = len(root_inputs._alive)
    del low, low_expanded
    assert len(root_inputs._alive) == held - 2


def test_bf16_kahan_refuses_a_sparse_embedding_left_out_of_keep_fp32() -> None:
    """torch-optimi failed at the first step ("copy_() between dense and sparse Tensors") on a
    sparse=True embedding cast to bf16. Kept in fp32 (the default) it trains; left out by a
    spec's keep_fp32 it is refused before the model is touched, naming the module and the
    keep_fp32 that works."""
    pytest.importorskip("optimi")

    def sparse_model() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Module()
        model.table = nn.Embedding(100, 16, sparse=True)
        model.head = nn.Linear(16, 4)
        model.forward = lambda rows: model.head(model.table(rows))  # type: ignore[method-assign]
        return model

    model = sparse_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(
        autoprec.UnsupportedModeError,
        match=r"sparse=True in 'table', outside keep_fp32\); keep them in fp32 "
        r"\(keep_fp32=\['head', 'table'\]\)",
    ):
        prepare(ModeSpec(mode="bf16_kahan", keep_fp32=("head",)), model, optimizer)
    assert model.table.weight.dtype == model.head.weight.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(ModeSpec(mode="bf16_kahan", keep_fp32=("table",)), model, optimizer)
    start = plan.model.table.weight.detach().clone()
    plan.step(plan.model(torch.randint(0, 100, (8,))).float().square().mean())
    assert plan.model.head.weight.dtype == torch.bfloat16
    assert not torch.equal(plan.model.table.weight.detach(), start)


def _norm_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize(
    "spec",
    [
        ModeSpec(mode="bf16_sr"),
        ModeSpec(mode="bf16_pure", keep_fp32=("0",)),
        ModeSpec(mode="bf16_kahan", keep_fp32=("0", "3")),
    ],
    ids=lambda spec: f"{spec.mode}-keep{len(spec.keep_fp32)}",
)
def test_an_fp32_copy_of_a_pure_bf16_model_runs_in_fp32(spec: ModeSpec) -> None:
    """README's EMA kept in fp32, AveragedModel(plan.model).float(), failed at its first call
    ("mat1 and mat2 must have the same dtype"): the copied hooks cast its inputs to bf16."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    model = _norm_mlp()
    x = torch.randn(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema = AveragedModel(plan.model, avg_fn=get_ema_avg_fn(0.999)).float()
    for _ in range(2):
        with plan.autocast():
            loss = plan.model(x).float().pow(2).mean()
        plan.step(loss)
        ema.update_parameters(plan.model)
    with torch.no_grad():
        averaged = ema(x)
        plain = copy.deepcopy(ema.module)
        for module in plain.modules():  # the same weights with no hooks: plain fp32
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        assert averaged.dtype == torch.float32
        assert torch.equal(averaged, plain(x))
        assert plan.model(x).dtype == torch.bfloat16  # the model itself is still pure bf16


@pytest.mark.parametrize(
    "spec",
    [
        ModeSpec(mode="amp_bf16", keep_fp32=("0",)),
        ModeSpec(mode="bf16_pure", keep_fp32=("0",)),
        ModeSpec(mode="bf16_sr"),
    ],
    ids=lambda spec: f"{spec.mode}-keep{len(spec.keep_fp32)}",
)
def test_a_converted_model_pickles_and_its_copy_hooks_its_own_state(spec: ModeSpec) -> None:
    """torch.save(plan.model) failed with keep_fp32 (closures as hooks; pure bf16's root hooks
    pickled as other objects)."""
    import io

    model = _norm_mlp()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    buffer = io.BytesIO()
    torch.save(plan.model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with plan.autocast():
        assert torch.equal(loaded(x), plan.model(x))
    copied = copy.deepcopy(plan.model)
    hook = next(iter(copied[0]._forward_pre_hooks.values()), None)
    original = next(iter(plan.model[0]._forward_pre_hooks.values()), None)
    if spec.keep_fp32:  # each copy's island is its own object
        assert hook is not None and original is not None
        assert hook.function.__self__ is not original.function.__self__


def test_pure_bf16_casts_a_buffer_two_modules_share_once() -> None:
    """Found by a hunt: pure bf16 cast a buffer once per module holding it, so one shared
    running mean became two tensors, one updated and one never read again (0.0 where fp32
    reads 4.39), and a state dict kept whichever came last."""

    class Stat(nn.Module):
        def __init__(self, mean: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("mean", mean)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training:
                with torch.no_grad():
                    self.mean.mul_(0.9).add_(0.1 * x.float().mean(0))
            return x - self.mean

    class Use(nn.Module):
        def __init__(self, mean: torch.Tensor) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)
            self.register_buffer("mean", mean)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x + self.mean)

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            mean = torch.zeros(8)
            self.stat, self.use = Stat(mean), Use(mean)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.use(self.stat(x))

    for keep in ((), ("stat",)):
        model = Shared()
        plan = prepare(
            ModeSpec(mode="bf16_pure", keep_fp32=keep),
            model,
            torch.optim.SGD(model.parameters(), lr=0),
        )
        for _ in range(5):
            plan.step(plan.model(torch.full((4, 8), 5.0)).float().sum())
        assert model.stat.mean is model.use.mean, keep
        assert model.stat.mean.dtype == (torch.float32 if keep else torch.bfloat16)
        assert float(model.use.mean[0]) > 1.5  # updated: 5 x (1 - 0.9**5)
    # one tensor under two names of one module (a review): cast once under both
    twice = nn.Linear(4, 4)
    table = torch.ones(4)
    twice.register_buffer("a", table)
    twice.register_buffer("b", table)
    prepare(ModeSpec(mode="bf16_pure"), twice, torch.optim.SGD(twice.parameters(), lr=0))
    assert twice.a is twice.b and twice.a.dtype == torch.bfloat16


def test_casting_hooks_skip_the_pytree_walk_when_nothing_is_cast_and_roots_are_looked_up() -> None:
    """Found by a hunt on models of thousands of layers: every pure-bf16 layer's input hook
    walked its arguments with torch's pytree (15 us a module, a forward 2.6x hand-written
    bf16's), and prepare() compared every module with every kept root (19 s at 4000 kept
    LayerNorms). Flat arguments with nothing to cast come back as they are; roots are looked
    up by ancestor."""
    from autoprec.modes.base import under_root
    from autoprec.modes.islands import cast_floats

    bf16, fp32 = torch.ones(2, dtype=torch.bfloat16), torch.ones(2)
    flat = (bf16, 3, None)
    assert cast_floats(flat, (torch.float32,), torch.bfloat16) is flat
    assert cast_floats({"x": bf16}, (torch.float32,), torch.bfloat16)["x"] is bf16
    cast = cast_floats((fp32, 3), (torch.float32,), torch.bfloat16)
    assert cast[0].dtype == torch.bfloat16 and cast[1] == 3
    nested = cast_floats(([fp32],), (torch.float32,), torch.bfloat16)
    assert nested[0][0].dtype == torch.bfloat16  # containers still walked
    from collections import deque  # a node the walk opens though it has no __dict__ (a review)

    assert cast_floats((deque([fp32]),), (torch.float32,), torch.bfloat16)[0][0].dtype == bf16.dtype
    roots = {"blocks.1.ln", "head"}
    assert under_root("blocks.1.ln", roots) and under_root("blocks.1.ln.weight_fn", roots)
    assert under_root("head.proj", roots)
    assert not under_root("blocks.1", roots) and not under_root("blocks.10.ln", roots)
    assert not under_root("headx", roots) and not under_root("blocks.1.lnx", roots)


class _Float64Head(nn.Module):
    """A frozen float64 operator and constants, computed in float64 on purpose."""

    def __init__(self) -> None:
        super().__init__()
        constants = torch.tensor([1.0 + 1e-9, 2.0, 3.0, 4.0], dtype=torch.float64)
        self.register_buffer("const", constants)
        self.op = nn.Parameter(torch.eye(4, dtype=torch.float64) + 1e-3, requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return ((h.double() @ self.op) * self.const).float()


@pytest.mark.parametrize(
    ("mode", "keep"), [("bf16_sr", ()), ("bf16_pure", ("phys",)), ("amp_bf16", ("phys",))]
)
def test_a_frozen_float64_part_stays_float64(mode: str, keep: tuple[str, ...]) -> None:
    """Found by a hunt: pure bf16 cast a frozen float64 operator to bf16 (a constant 1+1e-9 read
    1.0) and its forward failed ("double != BFloat16"); keeping it in fp32 was refused in every
    mode as "loaded in low precision"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    model.add_module("phys", _Float64Head())
    spec = ModeSpec(mode=mode, keep_fp32=keep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(spec, model, torch.optim.AdamW(model.parameters()))
    assert model.phys.op.dtype == model.phys.const.dtype == torch.float64
    assert model.phys.const[0].item() == 1.0 + 1e-9
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with plan.autocast():
        loss = nn.functional.mse_loss(plan.model(x).float(), y)
    plan.step(loss)
    assert model[0].weight.dtype == (torch.float32 if mode == "amp_bf16" else torch.bfloat16)


def test_fp8_leaves_a_float64_linear_alone() -> None:
    """A review: FP8 swapped a frozen float64 Linear (a physics operator) and moved its
    outputs 5.6%, though pure bf16 now leaves float64 parts as they are."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    model.add_module("op", nn.Linear(16, 16, bias=False).double().requires_grad_(False))
    spec = ModeSpec(mode="fp8_torchao", emulate=True, fp8_layers="all")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizerRebuiltWarning)
        plan = prepare(spec, model, optimizer)
    assert "op" not in plan.mode.fp8_modules(plan.model)
    assert type(model.op) is nn.Linear and model.op.weight.dtype == torch.float64
