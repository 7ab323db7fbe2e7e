"""The cache command, each process stopping itself (SIGSTOP) once it has written N shards in this run (0: right
after the store is prepared): the worker of tests/test_cache_tool.py's kill test, which kills it at that known shard
boundary. Usage: ``[torchrun ...] tests/paused_cache_tool.py N CACHE_ARGS...``."""

import os
import pathlib
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megatron_kd_plugin.commands.cache import main  # noqa: E402


def pause_at(pause_after: int):
    def on_shard_written(shards_written: int) -> None:
        if shards_written == pause_after:
            os.kill(os.getpid(), signal.SIGSTOP)
    return on_shard_written


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], on_shard_written=pause_at(int(sys.argv[1]))))
