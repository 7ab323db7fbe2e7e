#!/usr/bin/env bash
# The prepared GPU check, for one H200 without network, in under 8 minutes:
#   bash tools/gpu_check.sh [WHEEL_DIR]          (WHEEL_DIR default: tools/wheels)
# 1. finds Python >= 3.12 ($KD_PYTHON, .venv, python3.12, python3) and checks for torch with CUDA, triton, numpy,
#    pytest; whatever is missing is installed from WHEEL_DIR with `pip install --no-index` (into .venv, created
#    over the system's packages, when that Python is not a venv). If WHEEL_DIR cannot provide it, it prints the
#    wheels to put there and how to download them, and stops;
# 2. runs the kernel tests and the Triton fused-loss tests on the GPU (compiled Triton kernels, no interpreter;
#    bf16 chunk GEMMs with fp32 dX/dW through cuBLAS's out_dtype);
# 3. trains a KD student on GPU without TE or Bridge (tools/gpu_student_check.py: megatron-core GPTModel, local
#    layers, bf16, DDP + distributed optimizer, top-K dataset rows, forward_backward_no_pipelining; loss must fall);
# 4. runs the whole-step memory benchmark (tools/bench_step.py: a 2-layer megatron-core student, local layers, H=2880,
#    V=201,088, T = 4 x {2K, 8K, 32K}; student-only, Dense, the megatron-core peer, forward-chunked, fused x 2; <= 3 min);
# 5. runs the loss-head benchmark at gpt-oss-like shapes (tools/bench_loss_gpu.py: H=2880, V=201,088 and V/8,
#    T in {8192, 32768, 131072}; Dense vs Forward-chunked vs Fused PyTorch vs Fused Triton, + the GEMM floor)
#    in whatever is left of 8 minutes.
# Everything lands in bench_results/gpu_check-<UTC time>/: log.txt (all output), loss_gpu.md, step_gpu.md (the tables).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheels=${1:-$repo/tools/wheels}
out=$repo/bench_results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
started=$(date +%s)
needed=(torch triton numpy pytest)

python_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local candidate
  for candidate in "${KD_PYTHON:-}" "$repo/.venv/bin/python" python3.12 python3; do
    [ -n "$candidate" ] || continue
    candidate=$(command -v "$candidate" 2>/dev/null) || continue
    if python_ok "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

missing_modules() {  # the names in $needed that $1 cannot import
  "$1" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
    "${needed[@]}"
}

if ! py=$(find_python); then
  echo "error: no Python >= 3.12 found (set KD_PYTHON to one)"; exit 2
fi
missing=$(missing_modules "$py")
if [ -n "$missing" ]; then
  echo "== missing: $missing; installing from $wheels"
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    cat <<MSG
error: $py lacks: $missing, and $wheels holds no wheels. On a machine with network and the same platform
(Linux x86_64, Python $("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')), download them with their dependencies, e.g.
    python3.12 -m pip download -d tools/wheels -c tools/constraints.txt $missing
(torch pulls its nvidia-* CUDA wheels and triton), copy tools/wheels next to this script, and run it again.
MSG
    exit 3
  fi
  if [ "$("$py" -c 'import sys; print(sys.prefix == sys.base_prefix)')" = True ]; then
    if [ -e "$repo/.venv" ]; then
      echo "error: $py is not a venv and $repo/.venv exists: run with KD_PYTHON=$repo/.venv/bin/python"; exit 3
    fi
    "$py" -m venv --system-site-packages "$repo/.venv" && py=$repo/.venv/bin/python
  fi
  # shellcheck disable=SC2086  # $missing is a list of names
  if ! "$py" -m pip install --no-index --find-links "$wheels" $missing; then
    echo "error: pip could not install $missing from $wheels (see above for the wheel it lacks)"; exit 3
  fi
fi
echo "== python: $py"
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")' || exit 4
"$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || { echo "error: no CUDA device"; exit 4; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
cd "$repo" || exit 5
status=0
echo "== kernel and Triton fused-loss tests on the GPU ($(($(date +%s) - started)) s)"
timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_compile.py \
  tests/test_loss_triton.py || status=$?
echo "== KD student step under megatron-core's schedule, local layers, bf16 ($(($(date +%s) - started)) s)"
"$py" -c 'import megatron.core, zarr' 2>/dev/null ||  # megatron-core and zarr travel as wheels (no TE needed)
  "$py" -m pip install -q --no-index --find-links "$wheels" megatron-core zarr tqdm psutil || status=$?
timeout 120 "$py" tools/gpu_student_check.py || status=$?
echo "== whole KD step's peak memory, megatron-core student at gpt-oss V and H ($(($(date +%s) - started)) s)"
timeout 180 "$py" tools/bench_step.py --device cuda --hidden 2880 --vocab 201088 --heads 40 --groups 8 --ffn 2880 \
  --seq-lengths 2048,8192,32768 --micro-batch 4 --budget-s 150 --out "$out/step_gpu.md" || status=$?
left=$((460 - ($(date +%s) - started)))  # the benchmark gets what is left of ~7.7 minutes
if [ "$left" -ge 120 ]; then
  echo "== loss benchmark ($(($(date +%s) - started)) s; ${left} s left for it)"
  timeout "$left" "$py" tools/bench_loss_gpu.py --budget-s $((left - 60)) --out "$out/loss_gpu.md" || status=$?
else
  echo "== loss benchmark skipped: only ${left} s of the 8 minutes left (run tools/bench_loss_gpu.py alone)"
fi
echo "== done in $(($(date +%s) - started)) s, status $status; results in $out"
exit "$status"
