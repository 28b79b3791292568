"""Train the TinyGPT example with a precision profile: the two lines autoprec adds to a loop.

python -m examples.train_with_profile [--profile profiles/example-cpu-amp_bf16.json] [--steps 50]

The default profile is a hand-written example: loading it warns that it carries no evidence.
Pass the profile `autoprec tune` wrote for your model instead.
"""

from __future__ import annotations

import argparse

import torch

import autoprec
from examples.tiny_gpt import make_model


def next_token_batch(
    generator: torch.Generator, vocab: int = 512, length: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable toy task: token t+1 = (3 * token t + 1) mod vocab."""
    tokens = [torch.randint(0, vocab, (8, 1), generator=generator)]
    for _ in range(length):
        tokens.append((tokens[-1] * 3 + 1) % vocab)
    sequence = torch.cat(tokens, dim=1)
    return sequence[:, :-1], sequence[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="profiles/example-cpu-amp_bf16.json")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    model, _ = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    plan = autoprec.load_profile(args.profile).apply(model, optimizer)  # <- autoprec

    generator = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        tokens, targets = next_token_batch(generator)
        with plan.autocast():  # <- autoprec (was: a hand-made autocast context)
            loss = plan.model(tokens, targets)
        plan.step(loss, clip_grad_norm=1.0)  # backward, unscale, clip, step, zero_grad
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"trained with {plan}")


if __name__ == "__main__":
    main()
