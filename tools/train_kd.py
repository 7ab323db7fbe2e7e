"""Launch a KD recipe under torchrun; see megatron_kd_plugin/commands/train.py.

    torchrun --nproc_per_node 8 tools/train_kd.py --recipe NAME dataset.cache_path=cache.zarr train.train_iters=100
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megatron_kd_plugin.commands.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
