"""``python -m megatron_kd_plugin demo [--chat | --from-scratch | --mixture | --student-tokenizer X | --tokenizer-transfer X]``.

Which demo runs: the default heal (``megatron_kd_plugin.demo.pipeline``), or the one a flag names. Each demo parses
the rest of the arguments itself (``demo --mixture --help``).
"""

from __future__ import annotations

import importlib
import sys

# flag -> (module, whether the flag is a switch the demo does not take itself)
DEMOS = {
    "--chat": ("megatron_kd_plugin.demo.chat", True),
    "--from-scratch": ("megatron_kd_plugin.demo.scratch", True),
    "--mixture": ("megatron_kd_plugin.demo.mixture", True),
    "--student-tokenizer": ("megatron_kd_plugin.demo.student_tokenizer", False),
    "--tokenizer-transfer": ("megatron_kd_plugin.demo.tokenizer_transfer", False),
}
DEFAULT_DEMO = "megatron_kd_plugin.demo.pipeline"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = [flag for flag in DEMOS if any(arg == flag or arg.startswith(flag + "=") for arg in argv)]
    if len(named) > 1:
        print(f"demo: error: {' and '.join(named)} name different demos; pass one", file=sys.stderr)
        return 2
    if not named:
        return importlib.import_module(DEFAULT_DEMO).main(argv)
    module, switch = DEMOS[named[0]]
    return importlib.import_module(module).main([arg for arg in argv if arg != named[0]] if switch else argv)
