"""Scripts that print figures: run them as `python -m benchmarks.NAME`."""
