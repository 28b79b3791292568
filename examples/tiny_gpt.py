"""A nanoGPT-style decoder-only transformer, small enough for a CPU.

Factory for the CLI: ``autoprec probe --model examples.tiny_gpt:make_model``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.c_attn(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time, channels))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT with learned positions, pre-norm blocks and a weight-tied head (as nanoGPT)."""

    def __init__(
        self,
        vocab_size: int = 512,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)  # nanoGPT's initialisation
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batches(
    count: int = 48, batch_size: int = 8, seed: int = 0, vocab_size: int = 512, block_size: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable toy next-token task: token t+1 = (3 * token t + 1) mod vocab.

    Data factory for the CLI: ``autoprec tune ... --data examples.tiny_gpt:make_batches``.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = [torch.randint(0, vocab_size, (batch_size, 1), generator=generator)]
        for _ in range(block_size):
            tokens.append((tokens[-1] * 3 + 1) % vocab_size)
        sequence = torch.cat(tokens, dim=1)
        batches.append((sequence[:, :-1], sequence[:, 1:]))
    return batches


def make_model(batch_size: int = 8, seed: int = 0, **config: int) -> tuple[TinyGPT, torch.Tensor]:
    """A TinyGPT (``config`` overrides its sizes) and a batch of token ids to run it on."""
    torch.manual_seed(seed)
    model = TinyGPT(**config)
    tokens = torch.randint(0, model.wte.num_embeddings, (batch_size, model.block_size))
    return model, tokens


SMALL = {"vocab_size": 128, "block_size": 32, "n_layer": 1, "n_embd": 64}


def make_small_model() -> tuple[TinyGPT, torch.Tensor]:
    """A one-layer TinyGPT for quick runs (tests, smoke checks)."""
    return make_model(**SMALL)


def make_small_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`make_batches` sized for :func:`make_small_model`."""
    return make_batches(count=24, vocab_size=SMALL["vocab_size"], block_size=SMALL["block_size"])


def make_optimizer(params: Any, lr: float = 6e-4) -> torch.optim.AdamW:
    """nanoGPT's optimizer: AdamW, betas (0.9, 0.95), weight decay 0.1.

    Optimizer factory for the CLI: ``--optimizer examples.tiny_gpt:make_optimizer [--lr X]``.
    """
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    """nanoGPT's schedule: linear warm-up over 2% of the run, cosine decay to a tenth of the
    peak. Scheduler factory for the CLI: ``--scheduler examples.tiny_gpt:cosine_schedule
    --total-steps N``."""
    warmup = max(1, total_steps // 50)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
