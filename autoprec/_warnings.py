"""Warnings that point at the caller's line: the first frame outside autoprec, however deep
inside autoprec the warning is raised (``apply()`` -> ``prepare()`` -> a check; a plan's step;
an integration calling ``apply()`` for the user). A fixed ``stacklevel`` counted from one
entry point is wrong from every other: ``OutsideOptimizerWarning`` pointed at autoprec's own
``profile.py``."""

from __future__ import annotations

import sys
import warnings
from types import FrameType


def warn_caller(message: str | Warning, category: type[Warning] | None = None) -> None:
    """``warnings.warn`` with the stack level of the nearest frame outside the autoprec package
    (or the outermost frame, when every frame is autoprec's)."""
    frame = sys._getframe(1)
    level = 2  # 1 is this function's frame, 2 its caller's
    while frame.f_back is not None and _inside_autoprec(frame):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def _inside_autoprec(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name == "autoprec" or name.startswith("autoprec.")
