"""A plain training loop, without autoprec: the "before" of examples/loop_autoprec.py.

python -m examples.loop_plain tiny_gpt --steps 30
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch

EXAMPLES = ("tiny_gpt", "small_convnet", "raw_param_mlp", "flow_unet")


def forward_loss(example, model, batch):
    """The example's loss: its loss_fn(model(*inputs), target), or the model's own loss."""
    if hasattr(example, "loss_fn"):
        return example.loss_fn(model(*batch[:-1]), batch[-1])
    return model(*batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", choices=EXAMPLES)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    example = importlib.import_module(f"examples.{args.example}")
    model, _ = example.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, batch in zip(range(args.steps), itertools.cycle(example.make_batches())):
        loss = forward_loss(example, model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
