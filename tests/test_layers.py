from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from autoprec.layer_kinds import LAYER_KINDS, fp8_worthwhile, module_kind
from autoprec.layer_mix import LayerMix
from autoprec.layers import scan_model
from examples import raw_param_mlp, small_convnet, tiny_gpt
from tests.conftest import AttentionNet


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_a_forward_that_failed_on_the_given_input_asks_to_fix_it() -> None:
    """Found by a hunt: a forward failing on the input given was told "give an example input"."""
    failed = scan_model(nn.Sequential(nn.Linear(8, 16)), torch.randn(2, 9))
    [finding] = [f for f in failed.findings if f.startswith("no forward pass ran")]
    assert "fix the example input" in finding and "give an example input" not in finding
    unrun = scan_model(nn.Sequential(nn.Linear(8, 16)))
    assert any(f.endswith("give an example input") for f in unrun.findings)


def test_tiny_gpt_is_linear_dominated_and_fp8_compatible() -> None:
    mix = scan_model(*tiny_gpt.make_model())
    assert mix.model_class == "TinyGPT"
    assert mix.parameters == sum(p.numel() for p in tiny_gpt.make_model()[0].parameters())
    assert mix.kind("linear").flop_share == pytest.approx(0.933, abs=0.01)
    # attention scores: matmuls between activations (CPU SDPA kernel counted)
    assert mix.kind("other").flop_share == pytest.approx(0.067, abs=0.01)
    assert mix.kind("raw_param").flops == 0
    assert len(mix.linears) == 9 and all(linear.fp8_compatible for linear in mix.linears)
    assert not any(linear.fp8_worthwhile for linear in mix.linears)  # all small
    assert mix.fp8_eligible_flop_share == pytest.approx(mix.kind("linear").flop_share)
    keep = {k.fqn for k in mix.keep_fp32}
    assert {"wte", "wpe", "ln_f", "blocks.0.ln_1", "lm_head", "blocks.0.attn.c_attn"} <= keep
    assert "blocks.1.mlp.0" not in keep
    assert any("9 of 9 Linear layers fit FP8" in finding for finding in mix.findings)
    assert any("small" in finding for finding in mix.findings)


def test_tied_weights_are_counted_once() -> None:
    model, tokens = tiny_gpt.make_model()
    mix = scan_model(model, tokens)
    assert mix.parameters == sum(p.numel() for p in model.parameters())
    assert sum(share.parameters for share in mix.by_kind) == mix.parameters
    assert sum(share.parameter_share for share in mix.by_kind) == pytest.approx(1.0)
    assert sum(share.flop_share or 0 for share in mix.by_kind) == pytest.approx(1.0)


def test_trainable_complex_parameters_are_named() -> None:
    model = torch.nn.Module()
    model.spectral = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    model.frozen = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64), requires_grad=False)
    model.linear = torch.nn.Linear(4, 4)
    assert scan_model(model).complex_parameters == ("spectral",)
    assert scan_model(torch.nn.Linear(4, 4)).complex_parameters == ()


def test_sparse_gradient_embeddings_are_named() -> None:
    model = torch.nn.Module()
    model.table = torch.nn.Embedding(10, 4, sparse=True)
    model.bag = torch.nn.EmbeddingBag(10, 4, sparse=True).requires_grad_(False)
    model.dense = torch.nn.Embedding(10, 4)
    assert scan_model(model).sparse_gradient_modules == ("table",)


def _qlora_model() -> torch.nn.Module:
    """QLoRA-style: frozen bitsandbytes 4-bit (NF4) base Linears, trainable LoRA factors."""
    bnb = pytest.importorskip("bitsandbytes")

    class LoRA(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4")
            self.base.requires_grad_(False)
            self.a = torch.nn.Parameter(0.01 * torch.randn(4, 64))
            self.b = torch.nn.Parameter(torch.zeros(64, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.a.t() @ self.b.t()

    torch.manual_seed(0)
    return torch.nn.Sequential(LoRA(), torch.nn.ReLU(), LoRA(), torch.nn.Linear(64, 4)).to("cpu")


def test_a_4bit_base_is_scanned_in_training_mode_and_counted() -> None:
    """bitsandbytes' Linear4bit repacks its weight for CPU inference on an eval-mode no-grad
    forward (on CPUs with AVX512-BF16), after which the user's model failed to train ("a view
    of a leaf Variable that requires grad is being used in an in-place operation"): the scan,
    which runs the rest of the model in eval mode, leaves it in training mode. Its CPU matmul
    is bitsandbytes' own op, which torch's FLOP formulas do not know: counted here."""
    model = _qlora_model()
    seen = []
    model[0].base.register_forward_pre_hook(lambda module, _: seen.append(module.training))
    mix = scan_model(model, torch.randn(8, 64))
    assert seen == [True] and model.training and model[1].training  # flags restored
    base = next(linear for linear in mix.linears if linear.fqn == "0.base")
    assert base.bnb_4bit and not base.fp8_compatible and base.flops == 2 * 8 * 64 * 64
    assert any("2 bitsandbytes 4-bit Linear layers (0.base, 2.base)" in f for f in mix.findings)
    assert "0.base" not in {keep.fqn for keep in mix.keep_fp32 if "divisible" in keep.reason}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(8, 64)).square().mean().backward()  # still trains after the scan
    optimizer.step()


def test_torchs_own_transformer_layers_are_counted_as_they_train() -> None:
    """In eval mode without grad nn.MultiheadAttention takes a fused fast path that torch's FLOP
    formulas do not see: its projections and attention counted 0 and the FP8-compatible share
    read 100%. Training never takes it; the scan does not either, and leaves the switch as
    it was."""
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
    mix = scan_model(torch.nn.Sequential(encoder, torch.nn.Linear(256, 10)), torch.randn(2, 8, 256))
    tokens = 2 * 8
    in_and_out_projection = 2 * tokens * 256 * (3 * 256 + 256)
    assert mix.kind("raw_param").flops == in_and_out_projection  # F.linear on MHA's weights
    assert (mix.kind("other").flops or 0) > 0  # attention scores and values
    assert mix.fp8_eligible_flop_share is not None and mix.fp8_eligible_flop_share < 0.9
    assert torch.backends.mha.get_fastpath_enabled()


def test_multihead_attentions_out_projection_is_its_owners_raw_parameters() -> None:
    """nn.MultiheadAttention multiplies ``out_proj.weight`` itself and never calls out_proj: its
    parameters were counted as a Linear's while its FLOPs went to raw parameters, the FP8
    finding counted it among the Linears that fit, and its bias was named as a matmul operand."""
    mix = scan_model(AttentionNet(), torch.randn(2, 8, 64))
    assert [linear.fqn for linear in mix.linears] == ["inp", "out"]
    assert mix.kind("linear").parameters == 2 * (64 * 64 + 64)
    assert mix.kind("raw_param").parameters == 4 * 64 * 64 + 4 * 64  # in_proj and out_proj
    assert mix.raw_param_matmuls == ("att.in_proj_weight", "att.out_proj.weight")
    assert any(f.startswith("2 of 2 Linear layers fit FP8") for f in mix.findings), mix.findings
    assert "att.out_proj" not in {keep.fqn for keep in mix.keep_fp32}
    assert module_kind(AttentionNet().att.out_proj) is None


def test_convnet_is_conv_dominated() -> None:
    mix = scan_model(*small_convnet.make_model())
    assert (mix.kind("conv").flop_share or 0) > 0.99
    assert any(f.startswith("conv layers carry 100% of FLOPs") for f in mix.findings)
    (head,) = mix.linears
    assert head.fqn == "head" and not head.fp8_compatible  # 64 -> 10
    reasons = {k.fqn: k.reason for k in mix.keep_fp32}
    assert "stem.0" in reasons and "first layer" in reasons["stem.0"]
    assert "head" in reasons
    assert "stem.1" in reasons and "normalisation" in reasons["stem.1"]


def test_raw_parameter_matmuls_are_found() -> None:
    mix = scan_model(*raw_param_mlp.make_model())
    assert mix.raw_param_matmuls == ("w1", "w2")
    assert mix.kind("raw_param").parameters == 2 * 256 * 256
    assert mix.kind("raw_param").flop_share == pytest.approx(0.865, abs=0.01)
    assert any("matmuls on raw nn.Parameter tensors (w1, w2)" in f for f in mix.findings)
    assert mix.fp8_eligible_flop_share == pytest.approx(0.135, abs=0.01)


def test_hugging_face_llama_uses_linears_and_custom_norms() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    mix = scan_model(model, {"input_ids": torch.randint(0, 256, (2, 16))})
    assert (mix.kind("linear").flop_share or 0) > 0.8
    assert mix.kind("norm").parameters == 64 * (2 * 2 + 1)  # LlamaRMSNorm found by name
    assert mix.raw_param_matmuls == ()
    assert "model.embed_tokens" in {k.fqn for k in mix.keep_fp32}


def test_scan_leaves_the_model_unchanged() -> None:
    model, images = small_convnet.make_model()
    model.train()
    before = _state(model)
    scan_model(model, images)
    assert model.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name  # BatchNorm statistics untouched
    assert all(p.grad is None for p in model.parameters())


def test_scan_on_meta_device() -> None:
    with torch.device("meta"):
        model = tiny_gpt.TinyGPT()
        tokens = torch.zeros(8, 64, dtype=torch.long)
    mix = scan_model(model, tokens)
    reference = scan_model(*tiny_gpt.make_model())
    assert mix.forward_flops == reference.forward_flops
    assert mix.by_kind == reference.by_kind


def test_without_example_input_only_parameters_are_counted() -> None:
    model, _ = tiny_gpt.make_model()
    mix = scan_model(model)
    assert mix.forward_flops is None and mix.fp8_eligible_flop_share is None
    assert all(share.flops is None for share in mix.by_kind)
    assert any("no forward pass ran" in finding for finding in mix.findings)
    # first/last layers fall back to registration order
    assert {"blocks.0.attn.c_attn", "lm_head"} <= {k.fqn for k in mix.keep_fp32}


def test_failing_forward_is_reported_not_raised() -> None:
    model, _ = tiny_gpt.make_model()
    mix = scan_model(model, torch.zeros(2, 3, 4))  # floats where token ids belong
    assert mix.forward_flops is None
    assert mix.forward_error is not None and mix.forward_error.startswith("RuntimeError")
    assert any(mix.forward_error in finding for finding in mix.findings)


def test_model_without_parameters() -> None:
    mix = scan_model(nn.ReLU(), torch.ones(3))
    assert mix.parameters == 0
    assert mix.findings == ("the model has no parameters: there is nothing to train",)


def test_scan_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module but got function"):
        scan_model(tiny_gpt.make_model)  # type: ignore[arg-type]


def test_prenorm_wrapper_is_not_a_norm() -> None:
    class PreNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32)
            self.fn = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fn(self.norm(x))

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))

    assert module_kind(PreNorm()) is None
    assert module_kind(RMSNorm()) == "norm"
    mix = scan_model(PreNorm(), torch.ones(4, 32))
    assert mix.kind("linear").flop_share == 1.0


def test_kinds_cover_every_parameter() -> None:
    model = nn.Sequential(nn.Embedding(10, 16), nn.Conv1d(16, 16, 3), nn.BatchNorm1d(16))
    mix = scan_model(copy.deepcopy(model))
    assert [share.kind for share in mix.by_kind] == list(LAYER_KINDS)
    assert mix.kind("embedding").parameters == 160
    assert mix.kind("conv").parameters == 16 * 16 * 3 + 16
    assert mix.kind("norm").parameters == 32


@pytest.mark.parametrize(
    ("in_features", "out_features", "worthwhile"),
    [
        (4096, 1024, False),
        (4096, 1040, True),
        (4112, 1024, True),
        (128, 512, False),
        (8192, 8192, True),
    ],
)
def test_fp8_worthwhile_follows_torchao_tensorwise_filter(
    in_features: int, out_features: int, worthwhile: bool
) -> None:
    assert fp8_worthwhile(in_features, out_features) is worthwhile


def test_fp8_compatibility_needs_both_dims_divisible_by_16() -> None:
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 16))
    mix = scan_model(model, torch.ones(2, 64))
    assert [linear.fp8_compatible for linear in mix.linears] == [True, False, False]
    assert {"1", "2"} <= {k.fqn for k in mix.keep_fp32}


def test_hf_conv1d_counts_as_linear_and_says_why_fp8_skips_it() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    mix = scan_model(model, torch.randint(0, 128, (2, 16)))
    assert mix.raw_param_matmuls == ()  # not "matmuls on raw nn.Parameter tensors" any more
    assert (mix.kind("linear").flop_share or 0) > 0.9
    c_attn = next(linear for linear in mix.linears if linear.fqn.endswith("h.0.attn.c_attn"))
    assert (c_attn.in_features, c_attn.out_features) == (64, 192)  # from the (in, out) weight
    assert c_attn.hf_conv1d and not c_attn.fp8_compatible
    assert [linear.fqn for linear in mix.fp8_compatible_linears] == ["lm_head"]
    assert any(
        "Conv1D" in finding and "nn.Linear modules only" in finding for finding in mix.findings
    )


def test_weights_not_in_fp32_are_the_first_finding() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    findings = scan_model(model, torch.randn(2, 16, dtype=torch.bfloat16)).findings
    assert findings[0].startswith("weights not fp32 (torch.bfloat16 in 4 of 4 trainable tensors")
    assert not any("not fp32" in f for f in scan_model(model.float(), torch.randn(2, 16)).findings)


def test_an_only_matmul_layer_is_first_and_last_and_the_probe_says_who_keeps_what() -> None:
    """A token model of one Linear: its only matmul layer was called "first layer" alone; the
    probe listed FP8's skips under "keep in fp32", which no mode does with them."""
    from rich.console import Console

    from autoprec.display_probe import _kept_by_default

    model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    mix = scan_model(model, torch.randint(0, 64, (2, 8)))
    reasons = {k.fqn: k.reason for k in mix.keep_fp32}
    assert reasons["2"].startswith("first and last layer: sees raw inputs and produces")
    console = Console(width=200, record=True)
    console.print(_kept_by_default(mix))
    shown = console.export_text()
    assert "pure bf16 keeps in fp32: 0, 1\n" in shown
    assert "FP8 keeps out of FP8 (bf16 autocast): 2\n" in shown


def test_the_scan_leaves_max_norm_embeddings_and_parametrizations_as_they_are() -> None:
    # an Embedding(max_norm) renormalised the user's rows in the scan's forward; torch's
    # weight_norm / spectral_norm parametrizations were "normalisation" kept in fp32
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 16, max_norm=1.0)
            self.a = weight_norm(nn.Linear(16, 32))
            self.s = spectral_norm(nn.Linear(32, 32))
            self.out = nn.Linear(32, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.s(self.a(self.emb(x).mean(1))))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.emb.weight.mul_(5.0)  # rows beyond max_norm: a lookup would renormalise them
    before = model.emb.weight.detach().clone()
    layers = scan_model(model, torch.randint(0, 20, (4, 5)))
    assert torch.equal(model.emb.weight, before)
    assert not any("parametrizations" in keep.fqn for keep in layers.keep_fp32)
    assert layers.kind("raw_param").parameters == 0  # a parametrized Linear's are a Linear's


def test_an_lstms_fused_forward_is_counted() -> None:
    # one oneDNN op on a CPU (cuDNN's on a GPU), unknown to torch's formulas: an LSTM counted 0
    # FLOPs and the Linears beside it 100%, so FP8 looked like it reached the whole model
    lstm = nn.LSTM(64, 128, num_layers=2, bidirectional=True)
    layers = scan_model(lstm, torch.randn(10, 4, 64))
    tokens, gates = 10 * 4, 4 * 128
    first, second = gates * 64 + gates * 128, gates * 256 + gates * 128  # input + hidden weights
    assert layers.forward_flops == 2 * tokens * (first + second) * 2  # both directions
    assert "ran no matmuls" not in " ".join(layers.findings)


@pytest.mark.parametrize(
    "recurrent", [nn.GRU(8, 16, batch_first=True), nn.LSTM(8, 16, batch_first=True)]
)
def test_recurrent_layers_are_their_own_kind_not_raw_parameters(recurrent: nn.Module) -> None:
    # a GRU's weights are an nn.GRU's parameters, not `x @ self.W` in a custom module: the probe
    # listed them as "matmuls on raw nn.Parameter tensors (g.weight_ih_l0, ...)"
    model = nn.Sequential()
    model.add_module("rnn", recurrent)
    layers = scan_model(model, torch.randn(4, 5, 8))
    assert layers.raw_param_matmuls == ()
    assert layers.kind("raw_param").flops == 0
    assert layers.kind("recurrent").parameters == sum(p.numel() for p in recurrent.parameters())
    assert layers.kind("recurrent").flop_share == pytest.approx(1.0)
    assert any(f.startswith("100% of FLOPs are in recurrent layers") for f in layers.findings)
    assert not any("raw nn.Parameter" in f for f in layers.findings)


def test_a_scan_saved_before_the_recurrent_kind_reads_none_of_it() -> None:
    saved = scan_model(*raw_param_mlp.make_model()).model_dump()
    saved["by_kind"] = [share for share in saved["by_kind"] if share["kind"] != "recurrent"]
    old = LayerMix.model_validate(saved)
    assert old.kind("recurrent").parameters == 0 and old.kind("recurrent").flop_share == 0.0


class _DeepSupervised(nn.Module):
    """An auxiliary head only training calls."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 256)
        self.aux = nn.Linear(256, 256)
        self.head = nn.Linear(256, 64)
        self.norm = nn.BatchNorm1d(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.norm(self.stem(x)))
        out = self.head(hidden)
        if self.training:
            out = out + self.head(torch.relu(self.aux(hidden)))
        return out


def test_flops_are_counted_as_training_runs_the_model() -> None:
    """Found by a hunt: the FLOP forward ran in eval mode, so a head only training calls
    counted 0 FLOPs and FP8 said it was never called as a module."""
    model = _DeepSupervised()
    before = {name: b.clone() for name, b in model.named_buffers()}
    model.eval()
    mix = scan_model(model, torch.randn(8, 64))
    flops = {linear.fqn: linear.flops for linear in mix.linears}
    assert flops["aux"] == 2 * 8 * 256 * 256
    assert not model.training  # put back, with its buffers
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())
    # one example: training mode's BatchNorm refuses it, and eval mode counts what it can
    single = scan_model(_DeepSupervised(), torch.randn(1, 64))
    assert single.forward_flops and {lin.fqn: lin.flops for lin in single.linears}["aux"] == 0


def test_custom_norms_are_recognised_by_their_class_names_with_a_dimension_suffix() -> None:
    """Found by a hunt: a class name ending "Norm" alone missed SAM's and ConvNeXt's
    LayerNorm2d (its statistics then ran in bf16 under pure bf16, 0.39 off fp32's output),
    torchvision's FrozenBatchNorm2d and a norm named "...Normalization"."""

    def leaf(name: str) -> nn.Module:
        return type(name, (nn.Module,), {})()

    for name in ("LayerNorm2d", "FrozenBatchNorm2d", "RMSNormalization", "T5LayerNorm"):
        assert module_kind(leaf(name)) == "norm", name
    for name in ("Normalizer", "NormHead", "Norm2dWrapper"):
        assert module_kind(leaf(name)) is None, name


def test_the_probe_leaves_empty_buffer_slots_as_they_were() -> None:
    """Found by a hunt: the probe's scans put every buffer back and deleted the slots
    registered as None (InstanceNorm's running statistics, a BatchNorm with
    track_running_stats=False): the user's model then failed ("'InstanceNorm2d' object has no
    attribute 'running_mean'")."""
    import autoprec

    x = torch.randn(2, 3, 6, 6)
    instance = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, affine=True))
    untracked = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=False))
    for model in (instance, untracked):
        autoprec.probe(model, x)
        assert model[1]._buffers["running_mean"] is None
        model.eval()
        model(x)  # raised AttributeError


def test_a_frozen_low_precision_batchnorm_is_not_kept_for_its_running_statistics() -> None:
    """Found by a hunt: the keep-list kept a frozen bf16 backbone's BatchNorm for its running
    statistics, which prepare() refuses to keep (no fp32 weights to keep), and every
    pure-bf16 trial failed; the norm rule already left it."""
    from autoprec.layer_keep import default_keep_fp32

    backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
    model = nn.Sequential(backbone.to(torch.bfloat16).requires_grad_(False), nn.Linear(16, 10))
    kept = default_keep_fp32(model, [], running=("0.1.running_mean", "0.1.running_var"))
    assert "0.1" not in {entry.fqn for entry in kept}


def test_a_frozen_embedding_stays_kept_in_fp32_as_a_frozen_norm_does() -> None:
    """A hunt proposed leaving a frozen embedding off the keep list (a plain frozen lookup
    trains alike in bf16); a review found two it breaks: a frozen table the forward changes
    (max_norm's in-place renorm, an EMA codebook) became state outside the optimizer and
    failed every pure-bf16 mode, and an EmbeddingBag sums rows rounded first. It stays kept."""
    from autoprec.layer_keep import default_keep_fp32

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen, self.trained = nn.Embedding(100, 16, max_norm=1.0), nn.Embedding(100, 16)
            self.bag = nn.EmbeddingBag(100, 16)
            self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 100, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            mixed = self.frozen(ids) + self.trained(ids) + self.bag(ids).unsqueeze(1)
            return self.head(self.norm(mixed))

    model = Model()
    for module in (model.frozen, model.bag, model.norm):
        module.requires_grad_(False)
    kept = {entry.fqn for entry in default_keep_fp32(model, [])}
    assert {"frozen", "trained", "bag", "norm"} <= kept


class _OwnAutocast(nn.Module):
    """A forward that enters an autocast of its own for its second Linear (``enabled``: or a
    block that turns it off, keeping a part in fp32)."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.enabled):
            return self.second(hidden.float()).float()


class _AttentionUnderAutocast(nn.Module):
    """nn.MultiheadAttention (no Linear module called: its projections are raw parameters)
    under the forward's own autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.attention(x, x, x)[0].float()


class _RawUnderAutocast(nn.Module):
    """A raw ``x @ self.w`` under the forward's own autocast (no module call at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return (x @ self.w).float()


class _AutocastLinear(nn.Linear):
    """A Linear subclass whose own forward enters an autocast (after its pre-hooks ran)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x).float()


class _Fp32Autocast(nn.Module):
    """What ``torch.autocast("cuda", dtype=torch.float32)`` leaves on (CPU's autocast turns
    an fp32 one off): an autocast whose dtype is fp32 keeps a part in fp32, lowering nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float32)
        try:
            return self.a(x)
        finally:
            torch.set_autocast_enabled("cpu", enabled)
            torch.set_autocast_dtype("cpu", dtype)


class _KeptInFp32(nn.Module):
    """An autocast around a head whose forward turns it off: nothing runs lowered."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _Fp32Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.head(x)


class _Fp32Head(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 4)

    @torch.autocast("cpu", enabled=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_a_forward_entering_an_autocast_of_its_own_is_found_where_it_runs() -> None:
    """Found by a hunt replaying the seeds: such a forward set the fp32 reference's dtype. A
    review: a first version looked only at Linear, conv and embedding calls, and missed the
    attention, the raw matmul and the subclass below, and called an fp32 autocast lowering."""
    x = torch.randn(4, 8)
    mix = scan_model(_OwnAutocast(), x)
    assert mix.forward_autocast == "bfloat16 autocast on cpu at the model"
    assert any("autocast of its own (bfloat16 autocast on cpu at" in f for f in mix.findings)
    assert scan_model(_OwnAutocast(enabled=False), x).forward_autocast is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's block, not the forward's
        assert scan_model(_OwnAutocast(enabled=False), x).forward_autocast is None
    assert scan_model(_OwnAutocast()).forward_autocast is None  # no forward ran
    found = scan_model(_AttentionUnderAutocast(), torch.randn(3, 2, 8)).forward_autocast
    assert found is not None and found.startswith("bfloat16 autocast on cpu at")
    assert scan_model(_RawUnderAutocast(), x).forward_autocast == (
        "float16 autocast on cpu at the model"
    )
    assert scan_model(_AutocastLinear(8, 4), x).forward_autocast == (
        "bfloat16 autocast on cpu at the model"
    )
    wrapped = nn.Sequential(_AutocastLinear(8, 4))
    assert scan_model(wrapped, x).forward_autocast == "bfloat16 autocast on cpu at 0"
    assert scan_model(_Fp32Autocast(), x).forward_autocast is None
    assert scan_model(_KeptInFp32(), x).forward_autocast is None  # a second review


class _TiedByMatmul(nn.Module):
    """A token model whose head is the embedding read by a plain matmul (Gemma's reference
    code, many blog GPTs)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.block = nn.Sequential(
            nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return nn.functional.linear(self.block(h) + h, self.embed.weight)


def test_an_embedding_tied_by_a_plain_matmul_is_not_kept_and_runs_in_pure_bf16() -> None:
    """Found by a hunt: the probe kept the embedding in fp32 ("a lookup"), the tied matmul met
    bf16 activations with its fp32 weight, and every pure-bf16 mode failed at step 0 ("expected
    m1 and m2 to have the same dtype"); the last Linear called, an inner one, was said to
    produce the outputs the loss sees."""
    import autoprec

    model = _TiedByMatmul()
    tokens = torch.randint(0, 64, (4, 8))
    mix = scan_model(model, tokens)
    reasons = {k.fqn: k.reason for k in mix.keep_fp32}
    assert mix.raw_param_matmuls == ("embed.weight",)
    assert "embed" not in reasons and "block.3" in reasons  # the norm
    assert reasons["block.0"] == "first layer: sees raw inputs"
    assert "block.2" not in reasons  # an inner layer, not the last
    kept_module = scan_model(*tiny_gpt.make_model())  # a head tied through a module: kept
    assert any(k.reason.startswith("embedding") for k in kept_module.keep_fp32)

    def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    generator = torch.Generator().manual_seed(0)
    batches = [(t, t.roll(-1, 1)) for t in torch.randint(0, 64, (24, 4, 8), generator=generator)]
    report = autoprec.check(model, batches, loss_fn=next_token_loss, steps=8, modes=["bf16_sr"])
    [verdict] = report.verdicts
    assert verdict.status != "failed", verdict.reasons
    assert "embed" not in verdict.spec.keep_fp32


class _NoisyLabels(nn.Module):
    """A classifier whose head is followed by a learned label-transition matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 8)
        self.transition = nn.Parameter(torch.eye(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).softmax(-1) @ self.transition


def test_a_raw_matmul_after_the_head_leaves_it_the_last_layer() -> None:
    """A review: any raw matmul after the last module took the head out of FP8's last-layer
    skip; only a head tied to an embedding makes the last Linear an inner one."""
    reasons = {k.fqn: k.reason for k in scan_model(_NoisyLabels(), torch.randn(4, 16)).keep_fp32}
    assert reasons["head"] == "last layer: produces the outputs the loss sees"


class _MomentumTarget(nn.Module):
    """An online network and a target its forward moves by rebinding ``.data`` (MoCo's key
    encoder update)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Linear(16, 16)
        self.target = nn.Linear(16, 16).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for mine, theirs in zip(
                self.target.parameters(), self.online.parameters(), strict=True
            ):
                mine.data = 0.9 * mine.data + 0.1 * theirs.data
        return self.online(x) + self.target(x)


def test_the_scan_puts_back_parameters_a_forward_rebinds() -> None:
    """Found by a hunt: probe() left MoCo's key encoder moved, and the storages the update
    freed were reused by tensors the forward made, which the scan named as raw-parameter
    matmuls at random."""
    model = _MomentumTarget()
    before = _state(model)
    for _ in range(10):
        mix = scan_model(model, torch.randn(4, 16))
        assert mix.raw_param_matmuls == ()
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


class _QueueInABareModule(nn.Module):
    """MoCo's queue moved into a bare submodule nothing calls, read and written by its owner."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 16)
        self.bank = nn.Module()
        self.bank.register_buffer("queue", torch.randn(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self.encoder(x)
        scores = keys @ self.bank.queue.t()
        if self.training:
            with torch.no_grad():
                self.bank.queue = torch.cat([keys.detach(), self.bank.queue])[:32]
        return scores


def test_a_running_buffer_in_a_module_nothing_calls_is_not_kept() -> None:
    """Found by a hunt: the probe kept a bare module holding MoCo's queue in fp32; an fp32
    island converts at its module's own calls, so the queue stayed fp32 beside the owner's
    bf16 keys and every pure-bf16 mode failed at step 0. It is judged as state outside the
    optimizer instead."""
    import autoprec

    model = _QueueInABareModule()
    mix = scan_model(model, torch.randn(4, 16))
    assert "bank" not in {k.fqn for k in mix.keep_fp32}
    batches = [(torch.randn(4, 16), torch.randn(4, 32)) for _ in range(16)]
    report = autoprec.check(model, batches, loss_fn=nn.functional.mse_loss, steps=8,
                            modes=["bf16_sr"])  # fmt: skip
    [verdict] = report.verdicts
    assert verdict.status == "unsafe", verdict.reasons
    assert any("bank.queue" in r and "keeping that owner" in r for r in verdict.reasons)
