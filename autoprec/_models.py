"""The pydantic configuration every autoprec record shares."""

from __future__ import annotations

from pydantic import ConfigDict

FROZEN_RECORD = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="strings")
"""Immutable, no unknown field, and inf / NaN written as "Infinity" / "NaN": JSON has neither,
and pydantic's default, null, read back as "no clipping" (``clip_grad_norm=inf``) or failed to
load (an inf drift figure). Nested records serialise with their own configuration, so every
record takes this one."""
