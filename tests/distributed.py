"""Run a test body on N real processes: gloo, megatron-core ``parallel_state`` initialised, CPU work-arounds on.

    results = run_on_ranks(2, body, x, tp=2)   # body(x) runs on ranks 0 and 1; returns [result_rank0, result_rank1]

``body`` must be a module-level function (it is pickled into the rank processes). Results travel back as
``torch.save`` bytes, so tensors and plain data both work. A rank that raises fails the call with that rank's
traceback; ranks still waiting in a collective are then terminated.

Every wait of the test suite (this module's, and the subprocess timeouts of the tests) goes through
:func:`scaled`: ``KD_TEST_TIMEOUT_SCALE=3 pytest ...`` triples them all on a slow or busy machine (default 1; the
waits are already set for a loaded 2-core box, so they only bound a hang).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_lib
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch


TIMEOUT_SCALE = float(os.environ.get("KD_TEST_TIMEOUT_SCALE", "1"))


def scaled(seconds: float) -> float:
    """``seconds`` times ``KD_TEST_TIMEOUT_SCALE``: every wait of the test suite."""
    return seconds * TIMEOUT_SCALE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOADED = ("torch", "torch.distributed", "megatron.core.parallel_state", "megatron_kd_plugin.cpu_compat")
"""Modules the ranks' fork server imports once per test run, so that a spawn does not import them again."""


def _rank_context():
    """Ranks fork from one server process started at the first spawn with ``PRELOADED`` imported (a fresh
    interpreter, as ``spawn`` starts, but ~5 s of imports cheaper per rank). Forked children keep the server's
    environment, working directory and ``sys.path``: :func:`_rank_main` takes the caller's."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


def _rank_main(rank, world_size, tp, port, caller, fn, args, kwargs, results):
    environ, cwd, path = caller
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.chdir(cwd)
    sys.path[:] = path
    try:
        import torch.distributed as dist

        from megatron_kd_plugin.cpu_compat import apply_cpu_workarounds

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        apply_cpu_workarounds()
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=scaled(300)))
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        value = fn(*args, **kwargs)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 — every failure must reach the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_on_ranks(world_size: int, fn, *args, tp: int | None = None, timeout: float = 600, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks with tensor parallelism ``tp`` (default: all);
    ``timeout``: seconds before :func:`scaled`."""
    tp = world_size if tp is None else tp
    if world_size % tp:
        raise ValueError(f"world_size={world_size} is not a multiple of tp={tp}")
    ctx = _rank_context()
    results = ctx.Queue()
    port = _free_port()
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, tp, port, caller, fn, args, kwargs, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    values, errors = {}, {}
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < world_size:
            # after the first failure, give the other ranks a moment to report their own tracebacks
            wait = min(deadline, time.monotonic() + scaled(10)) if errors else deadline
            remaining = wait - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue_lib.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in values and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} before reporting"
                continue
            if ok:
                values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    if len(values) < world_size:
        missing = sorted(set(range(world_size)) - set(values))
        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f} s")
    return [values[r] for r in range(world_size)]
