"""The tasks of the ground-truth benchmark: eight families of training runs, CPU-sized.

Each task is a model, its training batches (the last few become the gate's held-out batches, as
in ``tune()``; enough of them that a long run sees each only a few times: overfitting would
reward modes that learn slower), a separate test set for the truth, the user's recipe (optimizer,
schedule) and a test metric, lower is better (held-out loss, or sample quality for the
flow-matching U-Net).
Everything is built from fixed seeds: the same task every time.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from autoprec.batching import forward_and_loss
from autoprec.plan import PrecisionPlan
from autoprec.recipe import TrainingRecipe
from examples import flow_unet, raw_param_mlp, tiny_gpt


@dataclass
class GroundTask:
    name: str
    family: str
    model: nn.Module
    batches: list[Any]
    """Training batches; ``tune()`` and ``check()`` hold out the last few of them."""
    test: list[Any]
    """The truth's test set (never seen by the gate)."""
    recipe: TrainingRecipe
    eval_fn: Callable[[nn.Module], float] | None = None
    """Also the truth's metric when given (e.g. sample quality); else the test loss."""
    notes: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    revision: int = 1
    """Part of the long runs' cache key: bump it when the task's model, data, recipe or metric
    changes (the other tasks' cached runs stay valid)."""

    @property
    def cache_name(self) -> str:
        return self.name if self.revision == 1 else f"{self.name}.r{self.revision}"

    def metric(self, plan: PrecisionPlan) -> float:
        """The truth's metric on a trained plan, lower is better: ``eval_fn`` when the task has
        one, else the mean test loss; evaluated in the mode's own precision."""
        plan.model.eval()
        try:
            with torch.no_grad(), plan.autocast():
                if self.eval_fn is not None:
                    return float(self.eval_fn(plan.model))
                losses = [
                    float(forward_and_loss(plan, batch, self.recipe.loss_fn)[0])
                    for batch in self.test
                ]
        finally:
            plan.model.train()
        return statistics.fmean(losses)


def _adamw(lr: float, weight_decay: float = 0.01) -> Callable[..., torch.optim.Optimizer]:
    def factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    factory.__qualname__ = f"AdamW(lr={lr:g})"
    return factory


def cosine_to(floor: float) -> Callable[..., Any]:
    def factory(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=total_steps, eta_min=floor
        )

    factory.__qualname__ = f"cosine to {floor:g}"
    return factory


def warmup_linear(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """The Hugging Face Trainer's schedule: 5% linear warm-up, then linear decay to 0."""
    warmup = max(1, total_steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / (total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _split(
    pairs: tuple[torch.Tensor, torch.Tensor], batch_size: int, train: int
) -> tuple[list[Any], list[Any]]:
    """Batches of ``batch_size`` from stacked ``(x, y)``; the first ``train`` for training."""
    x, y = pairs
    batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]
    batches = [b for b in batches if len(b[0]) == batch_size]
    return batches[:train], batches[train:]


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


# --- 1. a decoder LM from a Hugging Face config --------------------------------------------


def _markov_tokens(count: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Sequences from a fixed sparse Markov chain: a language with learnable structure."""
    table = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 4), generator=table)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(count, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (count,), generator=generator)
    for position in range(1, length):
        choice = torch.randint(0, 4, (count,), generator=generator)
        tokens[:, position] = successors[tokens[:, position - 1], choice]
    return tokens


def hf_llama_lm(total_steps: int) -> GroundTask:
    """A 2-layer Llama from a transformers config (the model computes its own loss), AdamW 1e-3
    with the HF Trainer's warm-up + linear decay."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)

    def batches(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
        tokens = _markov_tokens(count * 16, 32, 128, seed)
        return [{"input_ids": t, "labels": t} for t in tokens.split(16)]

    return GroundTask(
        "hf_llama_lm",
        "decoder LM (transformers config)",
        model,
        batches(600, 1),
        batches(8, 2),
        TrainingRecipe(total_steps=total_steps, optimizer=_adamw(1e-3), scheduler=warmup_linear),
    )


# --- 2. an encoder classifier with dropout -----------------------------------------------


class EncoderClassifier(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(16, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.position)
        return self.head(h.mean(dim=1))


def _marker_sequences(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences labelled by which of four marker tokens (0-3) occurs most often, 20% of
    the labels replaced by a random class: the test loss ends near the noise's floor instead of
    0 (a solved task's near-zero loss makes any two runs differ by "many" seed deviations)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 32, (count, 16), generator=generator)
    label = torch.randint(0, 4, (count,), generator=generator)
    for row in range(count):
        slots = torch.randperm(16, generator=generator)[:7]
        markers = torch.randint(0, 4, (3,), generator=generator)
        tokens[row, slots[:4]] = label[row]
        tokens[row, slots[4:]] = markers
    counts = torch.stack([(tokens == marker).sum(1) for marker in range(4)], 1)
    labels = counts.argmax(1)
    noisy = torch.rand(count, generator=generator) < 0.2
    labels[noisy] = torch.randint(0, 4, (int(noisy.sum()),), generator=generator)
    return tokens, labels


def encoder_dropout(total_steps: int) -> GroundTask:
    """A 2-layer transformer encoder classifier, dropout 0.1, AdamW 5e-4."""
    torch.manual_seed(0)
    train, _ = _split(_marker_sequences(500 * 32, 1), 32, 500)
    test, _ = _split(_marker_sequences(8 * 32, 2), 32, 8)
    return GroundTask(
        "encoder_dropout",
        "encoder classifier with dropout",
        EncoderClassifier(),
        train,
        test,
        TrainingRecipe(total_steps=total_steps, optimizer=_adamw(5e-4), loss_fn=_cross_entropy),
    )


# --- 3. a conv net and 6. an MLP on a real dataset (scikit-learn's digits) ----------------


@functools.cache
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return images[order], labels[order]


def _digit_batches(shape: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
    """1797 images: 1472 for training, the other 325 the test set. The training images are
    augmented (shifted by up to one pixel, Gaussian noise of 0.05) into 500 batches of 32, so
    that a long run does not just memorize them (overfitting would reward modes that learn
    slower)."""
    images, labels = _digits()
    images = images.reshape(len(labels), 8, 8)
    generator = torch.Generator().manual_seed(7)
    picks = torch.randint(0, 1472, (500 * 32,), generator=generator)
    shifts = torch.randint(-1, 2, (500 * 32, 2), generator=generator)
    augmented = torch.stack(
        [
            torch.roll(images[i], (int(a), int(b)), dims=(0, 1))
            for i, (a, b) in zip(picks, shifts, strict=True)
        ]
    )
    augmented = augmented + 0.05 * torch.randn(augmented.shape, generator=generator)
    train, _ = _split(((augmented - 0.5).reshape(-1, *shape), labels[picks]), 32, 500)
    test = [((images[1472:] - 0.5).reshape(-1, *shape), labels[1472:])]
    return train, test


class DigitsConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(32 * 16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def digits_convnet(total_steps: int) -> GroundTask:
    """A 3-layer conv net on the 8x8 digit images, AdamW 1e-3."""
    torch.manual_seed(0)
    train, test = _digit_batches((1, 8, 8))
    return GroundTask(
        "digits_convnet",
        "conv net (real images)",
        DigitsConvNet(),
        train,
        test,
        TrainingRecipe(total_steps=total_steps, optimizer=_adamw(1e-3), loss_fn=_cross_entropy),
    )


def _sgd(lr: float, momentum: float = 0.9, weight_decay: float = 5e-4) -> Callable[..., Any]:
    def factory(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    factory.__qualname__ = f"SGD(lr={lr:g}, momentum={momentum:g})"
    return factory


def convnet_sgd(total_steps: int) -> GroundTask:
    """The conv net with the classic CNN recipe: SGD with momentum 0.9, L2 weight decay 5e-4,
    cosine to 0. lr 0.05 was the best fp32 test loss of 0.02 / 0.05 / 0.1 (2 seeds each, 2000
    steps: 0.0169 / 0.0096 / 0.0111), chosen before any other mode ran. No Adam second moment:
    no optimizer-state rule applies, so the trial's measurements alone judge pure bf16."""
    torch.manual_seed(0)
    train, test = _digit_batches((1, 8, 8))
    return GroundTask(
        "convnet_sgd",
        "conv net, SGD recipe (momentum, cosine)",
        DigitsConvNet(),
        train,
        test,
        TrainingRecipe(
            total_steps=total_steps,
            optimizer=_sgd(0.05),
            scheduler=cosine_to(0.0),
            loss_fn=_cross_entropy,
        ),
    )


def _digits_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
    )


def digits_mlp(total_steps: int) -> GroundTask:
    """An MLP on the digits, AdamW 1e-4: the lr at which nearest-rounded bf16 loses updates."""
    torch.manual_seed(0)
    train, test = _digit_batches((64,))
    return GroundTask(
        "digits_mlp",
        "MLP on a real dataset",
        _digits_mlp(),
        train,
        test,
        TrainingRecipe(total_steps=total_steps, optimizer=_adamw(1e-4), loss_fn=_cross_entropy),
    )


# --- 4. a flow-matching U-Net scored by its samples ---------------------------------------


def flow_unet_samples(total_steps: int) -> GroundTask:
    """examples.flow_unet at 16 channels, AdamW 3e-4; metric: its ``eval_fn``, the samples'
    distance to the nearest image the data can hold (revision 2: revision 1 measured against 256
    random real images, whose floor of 0.27 for a perfect sample hid the models' differences)."""
    torch.manual_seed(0)
    batches = flow_unet.make_batches(count=300, batch_size=16, seed=0)
    test = flow_unet.make_batches(count=4, batch_size=16, seed=5)
    return GroundTask(
        "flow_unet",
        "flow-matching U-Net (samples)",
        flow_unet.FlowUNet(channels=16, time_dim=32),
        batches,
        test,
        TrainingRecipe(total_steps=total_steps, optimizer=_adamw(3e-4), loss_fn=flow_unet.loss_fn),
        eval_fn=flow_unet.eval_fn,
        revision=2,
    )


# --- 5. a raw nn.Parameter model ----------------------------------------------------------


def raw_parameters(total_steps: int) -> GroundTask:
    """examples.raw_param_mlp: matmuls on raw nn.Parameters, AdamW 3e-4."""
    torch.manual_seed(0)
    model, _ = raw_param_mlp.make_model()
    batches = raw_param_mlp.make_batches(count=500, seed=0)
    generator_check = raw_param_mlp.make_batches(count=508, seed=0)[500:]  # same W, unseen x
    return GroundTask(
        "raw_param_mlp",
        "raw nn.Parameter matmuls",
        model,
        batches,
        generator_check,
        TrainingRecipe(
            total_steps=total_steps, optimizer=_adamw(3e-4), loss_fn=raw_param_mlp.loss_fn
        ),
    )


# --- 7. a decaying lr schedule -----------------------------------------------------------


def _sine_regression(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(99)) / 5
    x = torch.randn(count, 32, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ weight)


def _regression_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(),
        nn.Linear(128, 16),
    )  # fmt: skip


def cosine_regression(total_steps: int) -> GroundTask:
    """A regression MLP, AdamW with cosine decay 1e-3 -> 1e-5 over the whole run."""
    torch.manual_seed(0)
    train, _ = _split(_sine_regression(500 * 64, 1), 64, 500)
    test, _ = _split(_sine_regression(8 * 64, 2), 64, 8)
    return GroundTask(
        "cosine_regression",
        "decaying lr schedule",
        _regression_mlp(),
        train,
        test,
        TrainingRecipe(
            total_steps=total_steps, optimizer=_adamw(1e-3), scheduler=cosine_to(1e-5), loss_fn=_mse
        ),
    )


# --- 8. a fine-tune at a tiny lr ---------------------------------------------------------


def tiny_lr_finetune(total_steps: int) -> GroundTask:
    """The regression MLP pre-trained in fp32 (600 steps at 1e-3), then fine-tuned at 1e-5 on
    a shifted target: updates far below a bf16 ulp of the trained weights."""
    torch.manual_seed(0)
    model = _regression_mlp()
    pretrain, _ = _split(_sine_regression(32 * 64, 3), 64, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(600):
        x, y = pretrain[step % len(pretrain)]
        optimizer.zero_grad()
        _mse(model(x), y).backward()
        optimizer.step()

    def shifted(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _sine_regression(count, seed)
        return x, y + 0.1 * torch.tanh(x[:, :16])

    train, _ = _split(shifted(500 * 64, 4), 64, 500)
    test, _ = _split(shifted(8 * 64, 5), 64, 8)
    return GroundTask(
        "tiny_lr_finetune",
        "fine-tune at a tiny lr",
        model,
        train,
        test,
        TrainingRecipe(
            total_steps=total_steps, optimizer=_adamw(1e-5, weight_decay=0.0), loss_fn=_mse
        ),
    )


# --- 9. nanoGPT's recipe: beta2 0.95, weight decay 0.1, warm-up + cosine, clipping -------


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def nanogpt_recipe(total_steps: int) -> GroundTask:
    """examples.tiny_gpt (2 layers, tied head) trained with nanoGPT's recipe: AdamW 6e-4 with
    betas (0.9, 0.95) and weight decay 0.1, warm-up then cosine to a tenth, gradients clipped
    at 1.0. With beta2 0.95 no optimizer-state rule applies: the trial's measurements judge
    every pure-bf16 mode."""
    torch.manual_seed(0)
    model, _ = tiny_gpt.make_model(vocab_size=128, block_size=32, n_layer=2, n_embd=64)

    def batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tokens = _markov_tokens(count * 16, 33, 128, seed + 10)
        return [(t[:, :-1], t[:, 1:]) for t in tokens.split(16)]

    return GroundTask(
        "nanogpt_recipe",
        "decoder LM, nanoGPT's recipe (beta2 0.95, clipping)",
        model,
        batches(600, 1),
        batches(8, 2),
        nanogpt_training(total_steps),
    )


def nanogpt_training(total_steps: int) -> TrainingRecipe:
    """nanoGPT's recipe over ``total_steps``: AdamW 6e-4, betas (0.9, 0.95), weight decay 0.1,
    warm-up then cosine to a tenth, clipping at 1.0, next-token cross-entropy."""
    return TrainingRecipe(
        total_steps=total_steps,
        optimizer=tiny_gpt.make_optimizer,
        scheduler=tiny_gpt.cosine_schedule,
        clip_grad_norm=1.0,
        loss_fn=_next_token_loss,
    )


def changed_groups(
    factory: Callable[..., torch.optim.Optimizer], change: Callable[[dict[str, Any]], None]
) -> Callable[[Any], torch.optim.Optimizer]:
    """``factory`` with ``change`` applied to every group of the optimizer it builds."""

    def changed(params: Any) -> torch.optim.Optimizer:
        optimizer = factory(params)
        for group in optimizer.param_groups:
            change(group)
        return optimizer

    return changed


def with_optimizer_groups(
    task: GroundTask, suffix: str, change: Callable[[dict[str, Any]], None]
) -> GroundTask:
    """``task`` with ``change`` applied to every group of the optimizer its recipe builds (one
    hyper-parameter changed, the rest as they were); its long runs are cached apart, under
    ``<name>.<suffix>``."""
    factory = task.recipe.optimizer
    assert callable(factory)  # every ground-truth task passes a factory
    changed = changed_groups(factory, change)
    changed.__qualname__ = f"{getattr(factory, '__qualname__', 'optimizer')}, {suffix}"
    recipe = dataclasses.replace(task.recipe, optimizer=changed, _cache={})  # cached per optimizer
    return dataclasses.replace(task, name=f"{task.name}.{suffix}", recipe=recipe)


TASKS: dict[str, Callable[[int], GroundTask]] = {
    "hf_llama_lm": hf_llama_lm,
    "encoder_dropout": encoder_dropout,
    "digits_convnet": digits_convnet,
    "flow_unet": flow_unet_samples,
    "raw_param_mlp": raw_parameters,
    "digits_mlp": digits_mlp,
    "cosine_regression": cosine_regression,
    "tiny_lr_finetune": tiny_lr_finetune,
    "nanogpt_recipe": nanogpt_recipe,
    "convnet_sgd": convnet_sgd,
}
QUICK_TASKS = ("digits_mlp", "tiny_lr_finetune")
