#!/usr/bin/env bash
# Install real Transformer Engine 2.20.2 and Megatron-Bridge 0.6.2 into the virtual environment whose
# python is given as $1 (default: .venv/bin/python). Works on machines without a GPU (DESIGN.md §3):
#   1. transformer-engine-cu13 (binary core library) + the build tools the extension needs;
#   2. transformer-engine-torch built from source against the venv's torch: the C++ extension only,
#      NVTE_PYTORCH_FORCE_BUILD=TRUE skips the download of a prebuilt wheel (unreachable here);
#      CPLUS_INCLUDE_PATH adds the pip nvidia/{cudnn,nccl,cu13} headers (the toolkit supplies crt/);
#      the long step: ~10 min on a 2-core machine (528 s measured on a fresh one, 2026-12-07), once per machine
#      (pip caches the built wheel); a line every minute says it is still building and for how long;
#   3. transformer-engine (the meta package TE looks for at import time), without extras;
#   4. megatron-bridge --no-deps: its full dependency list pulls fast-hadamard-transform (needs a CUDA
#      build) and nvidia-resiliency-ext (no wheel for glibc < 2.39; 0.4.1 breaks megatron.core), so
#      only the pure-Python packages its imports need are installed.
# Idempotent: when every pinned package is present it checks the imports and exits.
set -euo pipefail

PY="${1:-.venv/bin/python}"
if [[ ! -x "$PY" ]]; then
    echo "install_te_bridge.sh: no python at '$PY' (pass the venv's python as \$1)" >&2
    exit 2
fi
TE_VERSION=2.20.2
BRIDGE_VERSION=0.6.2
# pure-Python packages that `import megatron.bridge` and the modules the plugin uses (training.config, .state,
# .optim, data.loaders/samplers) need; megatron-energon and tensorboard are imported by those at module level
BRIDGE_IMPORT_DEPS=(
    "transformers==5.12.1" "hydra-core==1.3.8" "omegaconf==2.3.1" "einops==0.8.2" "rich==15.0.0"
    "six==1.17.0" "regex==2026.11.19" "pyyaml==6.0.4" "tqdm" "typing-extensions" "datasets==5.2.0"
    "megatron-energon==7.4.1" "tensorboard==2.21.0"
)
PINNED=("transformer_engine_cu13==$TE_VERSION" "transformer_engine_torch==$TE_VERSION"
        "transformer_engine==$TE_VERSION" "megatron-bridge==$BRIDGE_VERSION" "${BRIDGE_IMPORT_DEPS[@]}")

pip_install() { "$PY" -m pip install --disable-pip-version-check "$@"; }

import_check() {
    # torch first: TE's extension finds libnccl through torch's loaded libraries
    "$PY" - <<'PY'
import torch  # noqa: F401
import transformer_engine.pytorch  # noqa: F401
import megatron.bridge  # noqa: F401
from megatron.bridge.training.config import ConfigContainer, runtime_config_update  # noqa: F401
from megatron.bridge.data.base import DatasetProvider  # noqa: F401
from megatron.bridge.data.loaders import get_train_valid_test_num_samples  # noqa: F401
from megatron.bridge.training.optim import _get_scheduler  # noqa: F401
from megatron.bridge.training.state import GlobalState  # noqa: F401
import transformer_engine, megatron.bridge as mb
print(f"transformer_engine {transformer_engine.__version__}, megatron.bridge {mb.__version__}: import OK")
PY
}

if "$PY" - "${PINNED[@]}" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
    echo "install_te_bridge.sh: Transformer Engine $TE_VERSION and Megatron-Bridge $BRIDGE_VERSION already installed"
    import_check
    exit 0
fi

start=$(date +%s)
NVCC="$(command -v nvcc || true)"
if [[ -z "$NVCC" ]]; then
    echo "install_te_bridge.sh: nvcc (CUDA 13.0 toolkit) not on PATH; TE's torch extension needs its headers" >&2
    exit 2
fi
CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$NVCC")")")"
[[ -d "$CUDA_HOME/include/crt" ]] || CUDA_HOME=/usr/local/cuda

echo "== 1/4 transformer-engine-cu13 $TE_VERSION (binary core) and build tools"
pip_install "transformer-engine-cu13==$TE_VERSION" ninja wheel

echo "== 2/4 transformer-engine-torch $TE_VERSION from source (C++ extension, CUDA_HOME=$CUDA_HOME)"
echo "   the long step of the set-up: compiling Transformer Engine's C++ extension takes ~10 min on 2 cores"
echo "   (less with more cores: MAX_JOBS=${MAX_JOBS:-2} compilers in parallel), once per machine"
build_start=$(date +%s)
(   # pip prints only "still running..." while it compiles: say what and for how long, once a minute
    while sleep 60; do
        echo "[setup] still compiling Transformer Engine's torch extension: $(( ($(date +%s) - build_start) / 60 )) min so far (~10 min on 2 cores)"
    done
) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true' EXIT
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
INC="$SITE/nvidia/cudnn/include:$SITE/nvidia/nccl/include:$SITE/nvidia/cu13/include"
NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-2}" CUDA_HOME="$CUDA_HOME" \
    CPLUS_INCLUDE_PATH="$INC${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" PATH="$(dirname "$PY"):$PATH" \
    pip_install --no-build-isolation "transformer-engine-torch==$TE_VERSION"
kill "$ticker" 2>/dev/null || true
echo "   transformer-engine-torch built in $(( $(date +%s) - build_start )) s"

echo "== 3/4 transformer-engine $TE_VERSION (meta package, no extras)"
pip_install "transformer-engine==$TE_VERSION"

echo "== 4/4 megatron-bridge $BRIDGE_VERSION (--no-deps) and the pure-Python packages its imports need"
pip_install --no-deps "megatron-bridge==$BRIDGE_VERSION"
pip_install "${BRIDGE_IMPORT_DEPS[@]}"

import_check
echo "install_te_bridge.sh: done in $(( $(date +%s) - start )) s"
