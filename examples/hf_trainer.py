"""A tiny GPT-2 trained by the Hugging Face Trainer, tuned and applied by autoprec.

The lines autoprec adds to an ordinary Trainer script end with ``# autoprec`` (three of them):
the import, ``tune_trainer`` (which reads the Trainer's own optimizer, schedule, accumulation
and clipping) and ``apply_profile`` (which installs the winner through the Trainer's hooks).

    python -m examples.hf_trainer [--budget MINUTES] [--smoke]
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from autoprec.integrations.hf import apply_profile, tune_trainer  # autoprec


def _data(count: int) -> list[dict[str, torch.Tensor]]:
    """Sequences that count up modulo 64 from a random start: a pattern a small LM learns."""
    starts = torch.randint(0, 64, (count, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(32)) % 64
    return [{"input_ids": row, "labels": row} for row in tokens]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=2.0, help="tuning budget, minutes")
    parser.add_argument("--smoke", action="store_true", help="a few steps (CI)")
    options = parser.parse_args(argv)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir="runs/hf_trainer",
        max_steps=10 if options.smoke else 300,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        warmup_steps=0.05,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=args, train_dataset=_data(2048))
    budget = 0.3 if options.smoke else options.budget
    result = tune_trainer(trainer, budget_minutes=budget)  # autoprec
    apply_profile(trainer, result.profile)  # autoprec
    output = trainer.train()
    print(f"trained in {result.chosen.label}: {trainer.state.global_step} steps, "
          f"training loss {output.training_loss:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
