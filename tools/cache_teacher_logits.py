"""Cache a teacher's top-K next-token distribution into a Zarr v3 store; see megatron_kd_plugin/commands/cache.py.

    torchrun --nproc_per_node 2 tools/cache_teacher_logits.py --teacher TEACHER --data PREFIX \
        --output cache.zarr --seq-length 512 --topk 100 --tp 2

The same command as ``python -m megatron_kd_plugin cache`` (TEACHER: a Hugging Face checkpoint folder or a
save_gpt folder; ``--tp``/``--pp``/``--ep``).
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megatron_kd_plugin.commands.cache import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
