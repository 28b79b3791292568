"""How a list of names reads in a message: the first few, then ", ..." when more follow."""

from __future__ import annotations

from collections.abc import Sequence


def first_names(names: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c, ..."``: the first ``shown`` of ``names`` joined, ", ..." when there are more."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
