"""What every demo shares: the stage clock (each stage run with a printed name, its wall time kept), the stage
table, the ``--corpus`` / ``--text-key`` arguments and the one line a stopped demo ends with."""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

from megatron_kd_plugin.demo.data import TEXT_SUFFIXES

STOPPED = (ValueError, FileExistsError, subprocess.CalledProcessError)
"""What stops a demo with one line (``exit_code``): bad input (a setting, a corpus, a used output folder) or a
package command that failed."""


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


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """``--corpus PATH`` and ``--text-key KEY``: the text a demo reads through ``demo.data``."""
    parser.add_argument("--corpus", metavar="PATH", help="your own text instead of the stdlib sources: a folder of "
                        + "/".join("*" + s for s in TEXT_SUFFIXES) + " files (one document each, read as UTF-8) "
                        "or a .jsonl file (one JSON object per line, its text under --text-key)")
    parser.add_argument("--text-key", default="text", help="the JSONL field holding the text (default: %(default)s)")


def exit_code(error: Exception, output: pathlib.Path) -> int:
    """One line on stderr for a demo stopped by ``error`` (one of ``STOPPED``); the exit code: 1 when a package
    command failed (its output is above and in ``output``), 2 for bad input."""
    if isinstance(error, subprocess.CalledProcessError):
        print(f"demo: error: `{error.cmd}` failed (exit {error.returncode}); its output is above and in {output}/",
              file=sys.stderr)
        return 1
    print(f"demo: error: {error}", file=sys.stderr)
    return 2


def stage_lines(seconds: dict[str, float]) -> list[str]:
    """The markdown lines of the stage-time table (after a blank line)."""
    return ["", "| stage | seconds |", "|---|---:|"] + [f"| {stage} | {s:.1f} |" for stage, s in seconds.items()]
