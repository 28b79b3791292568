"""Runnable example models; each module exposes ``make_model() -> (model, example_input)``."""
