"""Launch a KD recipe: ``--recipe NAME`` plus Hydra-style overrides, under torchrun
(``python -m megatron_kd_plugin train``; ``tools/train_kd.py`` is a thin wrapper).

    torchrun --nproc_per_node=8 -m megatron_kd_plugin train --recipe qwen3_8b_to_1p7b_kd_32k_8gpu_h200_bf16_config \\
        dataset.cache_path=/data/qwen3_8b_top64_32k.zarr train.train_iters=100
    torchrun --nproc_per_node=2 -m megatron_kd_plugin train --recipe tiny_gpt_kd_cpu_fp32_config \\
        dataset.cache_path=outputs/caches/tiny_teacher.zarr model.tensor_model_parallel_size=2

With CUDA it runs Megatron-Bridge's ``pretrain()`` with the KD forward step (checked to import before anything is
built; what it lacks is named with the install command: ``pip install 'megatron_kd_plugin[gpu]'``, docs/getting-started.md);
without CUDA the same config runs under the CPU development loop (``megatron_kd_plugin.bridge.cpu_train``).
``--hf-path`` gives a recipe that takes a Hugging Face student (``hf_path``) its folder or hub id, ``--seq-length``
the sequence length (the recipe's ``seq_length``, else both seq_length overrides); ``plan`` takes the same arguments.
``--config-file`` merges a YAML of overrides first (it may name the plugin's classes as ``_target_``). An override
naming an unknown field, an unknown recipe or a bad cache stops the run before step one with the reason. """

from __future__ import annotations

import argparse
import sys


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that make a config, shared by ``train`` and ``plan`` (so a plan is of the run it plans)."""
    parser.add_argument("--recipe", help="recipe function name (train --list shows them)")
    parser.add_argument("--config-file", help="YAML of overrides merged before the command-line ones")
    parser.add_argument("--hf-path", help="the student's Hugging Face checkpoint, a local folder (config.json + "
                                          "*.safetensors) or a hub id, for recipes that take one")
    parser.add_argument("--seq-length", type=int, help="tokens per sample: the recipe's seq_length when it takes "
                        "one, else model.seq_length=N dataset.seq_length=N (the cache's must be a multiple of it)")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. train.train_iters=100")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron_kd_plugin train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the recipe names and exit")
    add_config_arguments(parser)
    return parser.parse_args(argv)


def _call_recipe(recipe: str, fn, kwargs: dict):
    """``fn(**kwargs)``; a default student that is a hub id the hub cannot give becomes one line saying so."""
    import inspect

    from megatron_kd_plugin.models.student import HubStudentError

    try:
        return fn(**kwargs)
    except HubStudentError as error:
        if "hf_path" in kwargs:
            raise
        default = inspect.signature(fn).parameters["hf_path"].default
        raise ValueError(f"recipe {recipe}: its default student {default!r} is a Hugging Face hub id and could not be "
                         f"fetched ({error.reason}); --hf-path takes a local folder (config.json + *.safetensors)"
                         ) from None


def build_config(recipe: str, overrides: list[str], config_file: str | None = None, hf_path: str | None = None,
                 seq_length: int | None = None):
    """The recipe's config with the YAML file and the overrides applied (ValueError/OverridesError on bad input);
    ``hf_path`` is passed to a recipe that takes one (and refused by one that does not); ``seq_length`` to a recipe
    that takes one, else it becomes the ``model.seq_length`` / ``dataset.seq_length`` overrides (before the others)."""
    import inspect

    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_kd_plugin.bridge import register
    from megatron_kd_plugin.recipes import RECIPES

    register()
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(sorted(RECIPES))}")
    parameters = inspect.signature(RECIPES[recipe]).parameters
    kwargs = {}
    if hf_path is not None:
        if "hf_path" not in parameters:
            raise ValueError(f"--hf-path={hf_path}: recipe {recipe} builds its own student (it takes no hf_path)")
        kwargs["hf_path"] = hf_path
    if seq_length is not None:
        if seq_length < 1:
            raise ValueError(f"--seq-length={seq_length}: must be >= 1")
        if "seq_length" in parameters:
            kwargs["seq_length"] = seq_length
        else:
            overrides = [f"model.seq_length={seq_length}", f"dataset.seq_length={seq_length}", *overrides]
    return process_config_with_overrides(_call_recipe(recipe, RECIPES[recipe], kwargs), config_filepath=config_file,
                                         cli_overrides=overrides)


PRETRAIN_NEEDS = {"nvidia_resiliency_ext": "nvidia-resiliency-ext", "modelopt": "nvidia-modelopt[torch]"}
"""Modules Bridge's ``pretrain`` imports that a plain ``megatron-bridge --no-deps`` install lacks -> pip names."""


def import_pretrain():
    """Bridge's ``pretrain`` function; ImportError with one line naming what to install when it cannot import."""
    try:
        from megatron.bridge.training.pretrain import pretrain
    except ImportError as error:
        missing = error.name or str(error)
        package = PRETRAIN_NEEDS.get(missing.split(".")[0], missing)
        raise ImportError(f"Megatron-Bridge's pretrain() cannot import {missing!r}: install {package} (on a CUDA "
                          "machine: pip install 'megatron_kd_plugin[gpu]', see docs/getting-started.md)") from error
    return pretrain


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        from megatron_kd_plugin.recipes import RECIPES

        print("\n".join(sorted(RECIPES)))
        return 0
    if not args.recipe:
        print("train: --recipe NAME is required (--list shows them)", file=sys.stderr)
        return 2
    import torch
    from megatron.bridge.training.utils.omegaconf_utils import OverridesError

    from megatron_kd_plugin.bridge.config import check_kd_config
    from megatron_kd_plugin.bridge.forward_step import kd_forward_step
    from megatron_kd_plugin.bridge.resume import check_resume_data

    try:
        pretrain = import_pretrain() if torch.cuda.is_available() else None   # GPU installs only: before any work
        cfg = build_config(args.recipe, args.overrides, args.config_file, args.hf_path, args.seq_length)
        check_kd_config(cfg)   # store, sizes, loss options: refuse now rather than after model setup
        check_resume_data(cfg)   # a resume continues on the data it was trained on
    except (ImportError, ValueError, OverridesError) as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 2

    if pretrain is not None:
        pretrain(cfg, kd_forward_step)
        return 0
    import torch.distributed as dist

    from megatron_kd_plugin.bridge.cpu_train import MasterPortInUse, train_on_cpu

    try:
        train_on_cpu(cfg, kd_forward_step)   # logs every logger.log_interval steps; history.jsonl in tensorboard_dir
    except MasterPortInUse as error:
        print(f"train: error: {error}", file=sys.stderr)
        return 2
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
