"""``python -m megatron_kd_plugin COMMAND [ARGS...]``.

Commands:
  demo      the end-to-end job on an embedded default: a HF teacher trained and cached, a pruned copy healed
            from the cache by KD (and by CE as control), all evaluated (--from-scratch: the first demo;
            --student-tokenizer unigram|bpe|PATH: cross-tokenizer KD against CE and same-tokenizer KD,
            bits per byte)
  cache     run a teacher once over token data and write its top-K (or sampled) cache store (under torchrun)
  train     distil a student from a cache store with a KD recipe (Bridge's pretrain() on GPU, a CPU loop without)
  inspect   print (and optionally plot) what a teacher top-K cache store holds
  copy      copy a store between a folder, s3:// and msc://, valid at every moment, verified at the end
  plan      per-GPU memory of a KD run by component (weights ... loss head) and whether it fits a GPU (train's
            arguments)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": "megatron_kd_plugin.demo.command",
    "cache": "megatron_kd_plugin.commands.cache",
    "train": "megatron_kd_plugin.commands.train",
    "inspect": "megatron_kd_plugin.commands.inspect",
    "copy": "megatron_kd_plugin.commands.copy",
    "plan": "megatron_kd_plugin.commands.plan",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
