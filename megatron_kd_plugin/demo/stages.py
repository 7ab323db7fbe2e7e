"""The demos' stage clock: runs each stage with a printed name and keeps its wall time, and the stage table."""

from __future__ import annotations

import time


class StageClock:
    """``clock(name, fn, *args, **kwargs)`` prints ``[demo] name ...``, returns ``fn(*args, **kwargs)`` and keeps its
    wall time in ``clock.seconds[name]`` (stages in the order run)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn, *args, **kwargs):
        print(f"[demo] {name} ...", flush=True)
        start = time.perf_counter()
        value = fn(*args, **kwargs)
        self.seconds[name] = time.perf_counter() - start
        return value


def stage_lines(seconds: dict[str, float]) -> list[str]:
    """The markdown lines of the stage-time table (after a blank line)."""
    return ["", "| stage | seconds |", "|---|---:|"] + [f"| {stage} | {s:.1f} |" for stage, s in seconds.items()]
