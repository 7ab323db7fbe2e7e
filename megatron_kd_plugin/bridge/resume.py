"""A run resumes only on the data it was trained on: its checkpoint's dataset settings against the run's.

A resumed run continues its data order at ``consumed_samples`` (``cache.KDRows``, ``cache.BlendedRows``), which is
that run's order only for the same blend, split, seed and shuffling (``TopKCacheDatasetProvider.data_identity``).
Both training paths write the run's config beside every checkpoint (Bridge's ``run_config.yaml`` in
``<checkpoint.load>/iter_NNNNNNN/``: the CPU loop's ``cpu_checkpoint.save_checkpoint`` and Bridge's own
``save_checkpoint`` alike), so before a run loads a checkpoint, ``check_resume_data`` reads the dataset section
the checkpoint was trained with and refuses, in one line naming what changed, a run whose data differ. A run that
only starts from a checkpoint's weights (Bridge's ``checkpoint.finetune``, or ``checkpoint.pretrained_checkpoint``)
is not a resume and is not checked.
"""

from __future__ import annotations

import dataclasses
import json
import os

import yaml
from megatron.bridge.training.utils.checkpoint_utils import (
    checkpoint_exists,
    get_checkpoint_name,
    get_checkpoint_run_config_filename,
    get_checkpoint_train_state_filename,
    read_train_state,
)

from megatron_kd_plugin.bridge.provider import TopKCacheDatasetProvider

TRACKER_PREFIX = "latest"
"""Bridge's tracker file is ``<save>/latest_train_state.pt``."""


def saved_dataset(load_dir: str, step: int | None = None) -> TopKCacheDatasetProvider | None:
    """The dataset settings of the checkpoint at ``step`` (None: the latest) in ``load_dir`` as a provider (from its
    ``run_config.yaml``); None when there is no checkpoint or it holds no such file."""
    if step is None:
        if not checkpoint_exists(load_dir):
            return None
        read_train_state.cache_clear()   # Bridge caches it by file name; a rerun in this process saved a newer one
        step = read_train_state(get_checkpoint_train_state_filename(load_dir, prefix=TRACKER_PREFIX)).step
    path = get_checkpoint_run_config_filename(get_checkpoint_name(load_dir, step))
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        section = (yaml.safe_load(f) or {}).get("dataset") or {}
    names = {field.name for field in dataclasses.fields(TopKCacheDatasetProvider) if field.init}
    return TopKCacheDatasetProvider(**{key: value for key, value in section.items() if key in names})


def _described(value) -> str:
    if isinstance(value, list) and all(isinstance(entry, list) and len(entry) == 2 for entry in value):
        return " ".join(path if weight is None else f"{weight:g} {path}" for path, weight in value)
    return json.dumps(value)


def data_change(saved: TopKCacheDatasetProvider, current: TopKCacheDatasetProvider) -> str | None:
    """What differs between two runs' data identities, in words (the first difference), or None."""
    before, after = (json.loads(json.dumps(provider.data_identity())) for provider in (saved, current))
    for key in [*before, *(key for key in after if key not in before)]:
        if key == "splits":
            for split in before[key]:
                if before[key][split] != after[key][split]:
                    return (f"the {split} blend was {_described(before[key][split])!r}, now "
                            f"{_described(after[key][split])!r}")
        elif before.get(key) != after.get(key):
            return f"dataset {key} was {_described(before.get(key))}, now {_described(after.get(key))}"
    return None


def check_resume_data(cfg) -> None:
    """ValueError (one line) when ``cfg`` would resume from a checkpoint in ``checkpoint.load`` that was trained on
    other data (module docstring); nothing without such a checkpoint, for a fine-tuning start, or for a checkpoint
    without its run config."""
    load_dir = cfg.checkpoint.load
    if not load_dir or getattr(cfg.checkpoint, "finetune", False):
        return
    saved = saved_dataset(load_dir, getattr(cfg.checkpoint, "ckpt_step", None))
    if saved is None:
        return
    change = data_change(saved, cfg.dataset)
    if change is not None:
        raise ValueError(f"checkpoint.load={load_dir} holds a run trained on other data: {change}; resume with the "
                         "data it was trained on, or start a new run (another checkpoint.save/load) from its "
                         "weights (checkpoint.pretrained_checkpoint)")
