#!/usr/bin/env bash
# The prepared GPU check, for one lent H200 without network: every figure back in under 8 minutes.
#   bash tools/gpu_check.sh --download   # on a machine with the package index: fetch tools/gpu_wheels.txt's wheels
#                                        # into tools/wheels/ (ignored by git) and check they stay under 60 MiB
#   bash tools/gpu_check.sh              # on the GPU machine (with tools/wheels/ carried in the checkout)
#
# The GPU machine has torch (a CUDA build), triton, numpy and transformers, but no megatron-core, zarr or TE and no
# network. So, before anything runs:
#   preflight: a Python >= 3.12 ($KD_PYTHON, python3.12, python3) with torch, triton and numpy FROM THE MACHINE
#     (they are not in the wheel set); every wheel of tools/gpu_wheels.txt present in tools/wheels/; missing
#     anything: refuse at once, naming it. Then a venv made with --system-site-packages ($KD_GPU_VENV, default
#     .gpu-venv; never the system Python) gets the wheels offline (pip --no-index), and every stage's imports are
#     checked.
# Stages (budget = its own timeout; expected GPU time in brackets, estimated: no GPU has run this yet):
#   kernels  80 s [~60 s: Triton compiles + autotunes twice per kernel, one gloo TP=2 spawn]: the kernel and
#            Triton fused-loss tests on the GPU (compiled, no interpreter; bf16 GEMMs, fp32 dX/dW);
#   student  80 s [~40 s: a 4-layer teacher writes a 64-sample cache, 30 student iterations]: a KD student trained
#            under megatron-core's schedule (tools/gpu_student_check.py: local layers, bf16, DDP + distributed
#            optimizer; loss must fall); its loss curve;
#   step    130 s [~100 s: 6 variants x 3 lengths, one process each; no child starts after 100 s]: the whole KD step's peak memory, megatron-core
#            student at gpt-oss H and V, fused vs the megatron-core peer (tools/bench_step.py);
#   loss    what is left of 440 s, at least 80 s [~100 s; runs it cannot afford are reported as such]: the loss head at gpt-oss shapes (H=2880, V=201,088 and V/8):
#            ms and peak vs the analytic floor, Dense / Forward-chunked / Fused PyTorch / Fused Triton, and Triton
#            vs PyTorch kernels (tools/bench_loss_gpu.py).
#   Preflight + install ~30 s (32 s measured in the CPU rehearsal); whole run 440 s (7 min 20 s) when no stage is
#   cut, at most ~450 s when every stage hits its timeout (each gets 10 s to die): under 8 minutes with margin.
# Without CUDA (the CPU rehearsal, tests/test_gpu_check.py) each stage reports "no CUDA" and runs its CPU smoke
# instead (kernels: collection only), so every stage still starts.
#
# Results go to $OUT when set (the device runner returns it), else bench_results/gpu_check-<UTC time>/: log.txt (all
# output), <stage>.log, loss_gpu.md, step_gpu.md, and summary.md: every figure line of every stage, appended as it
# is printed, and each stage's end (ok / FAILED / CUT at its timeout), so a cut run still returns its numbers.
# Exit status: 0 all stages ok, 1 a stage failed or was cut (never 124: that is the whole command's timeout),
# 2 no Python, 3 something missing (named).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheels=${KD_GPU_WHEELS:-$repo/tools/wheels}   # the tests point it elsewhere
wheel_list=$repo/tools/gpu_wheels.txt
from_machine=(torch triton numpy)   # never in the wheel set (nor what they need): the GPU machine's CUDA build
max_wheel_mib=60
total_s=440                        # preflight (~30 s) + the stages' budgets add up to this (see the table above)
declare -A budget_s=([kernels]=80 [student]=80 [step]=130 [loss]=80)   # loss: at least this
# Modules each stage imports (beyond the repository and the standard library); checked after the install.
declare -A stage_imports=([kernels]="torch triton numpy pytest megatron.core"
                          [student]="torch triton numpy megatron.core zarr numcodecs tqdm"
                          [step]="torch triton numpy megatron.core tqdm"
                          [loss]="torch triton numpy")

wheel_pins() {  # "name==version" of every wheel in the list
  sed -e 's/#.*//' -e 's/[[:space:]]//g' "$wheel_list" | grep -v '^$'
}

wheel_file() {  # the file in $wheels for one "name==version" (names normalised as in wheel file names), or nothing
  local name=${1%%==*} version=${1##*==} file
  name=$(printf '%s' "$name" | tr 'A-Z.-' 'a-z__')
  for file in "$wheels"/*.whl; do
    case $(basename "$file" | tr 'A-Z.-' 'a-z__') in "${name}_${version//[.-]/_}_"*) echo "$file"; return 0;; esac
  done
  return 1
}

if [ "${1:-}" = "--download" ]; then
  mkdir -p "$wheels"
  py=${KD_PYTHON:-python3}
  "$py" -m pip download --no-deps --only-binary=:all: --implementation cp --python-version 3.12 --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheels" -r "$wheel_list" || exit 3
  files=()
  for pin in $(wheel_pins); do
    file=$(wheel_file "$pin") || { echo "error: no wheel for $pin in $wheels after the download"; exit 3; }
    files+=("$file")
  done
  bytes=$(cat "${files[@]}" | wc -c)
  echo "== ${#files[@]} wheels, $((bytes / 1024)) KiB in all ($wheels); the limit is $max_wheel_mib MiB"
  [ "$bytes" -lt $((max_wheel_mib * 1024 * 1024)) ] || { echo "error: the wheel set exceeds $max_wheel_mib MiB"; exit 3; }
  exit 0
fi

out=${OUT:-$repo/bench_results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
summary=$out/summary.md
exec > >(tee -a "$out/log.txt") 2>&1
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }

# ---- preflight: refuse at once, naming what is missing -------------------------------------------------------
echo "== preflight: torch, triton and numpy come from the machine (not from tools/wheels); the rest from $wheels"
py=
for candidate in "${KD_PYTHON:-}" python3.12 python3; do
  [ -n "$candidate" ] && candidate=$(command -v "$candidate" 2>/dev/null) || continue
  if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then py=$candidate; break; fi
done
[ -n "$py" ] || { echo "error: no Python >= 3.12 found (set KD_PYTHON to one)"; exit 2; }
missing=$("$py" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' \
  "${from_machine[@]}")
[ -z "$missing" ] || { echo "error: $py lacks $missing, which the GPU machine must provide (not carried as wheels)"; exit 3; }
absent=()
for pin in $(wheel_pins); do wheel_file "$pin" >/dev/null || absent+=("$pin"); done
if [ ${#absent[@]} -gt 0 ]; then
  echo "error: $wheels lacks the wheels ${absent[*]}; run 'bash tools/gpu_check.sh --download' where the package"
  echo "index is reachable and carry tools/wheels/ with the checkout"; exit 3
fi
carried=$(du -sk --exclude=.git --exclude=.venv --exclude=.gpu-venv --exclude=bench_results "$repo" | cut -f1)
echo "== python $py; wheels $(cat "$wheels"/*.whl | wc -c | awk '{printf "%.1f", $1 / 2^20}') MiB; checkout carried ${carried} KiB"

venv=${KD_GPU_VENV:-$repo/.gpu-venv}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv --system-site-packages "$venv" 2>/dev/null ||
    { rm -rf "$venv"; "$py" -m venv --system-site-packages --without-pip "$venv"; } ||
    { echo "error: $py -m venv --system-site-packages $venv failed"; exit 3; }
fi
vpy=$venv/bin/python
pip=("$vpy" -m pip)
"$vpy" -m pip --version >/dev/null 2>&1 || pip=("$py" -m pip --python "$vpy")   # a venv made without pip
# --no-deps: the list is the whole closure (the import check below proves it); a resolver would also re-check the
# machine's own torch requirements, which a CUDA image need not satisfy as pip sees them.
# shellcheck disable=SC2046  # one argument per wheel file
if ! "${pip[@]}" install -q --no-index --no-deps --disable-pip-version-check \
    $(for pin in $(wheel_pins); do wheel_file "$pin"; done); then
  echo "error: the wheels of $wheels do not install offline into $venv (pip names what is missing above)"; exit 3
fi
all_imports=$(printf '%s\n' "${stage_imports[@]}" | tr ' ' '\n' | sort -u | tr '\n' ' ')
missing=$("$vpy" -c 'import importlib, sys
bad = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m} ({type(e).__name__}: {e})")
print("; ".join(bad))' $all_imports)
[ -z "$missing" ] || { echo "error: after the install the stages cannot import: $missing"; exit 3; }
cuda=$("$vpy" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "")')
versions=$("$vpy" -c 'import torch, triton, numpy; print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")')
echo "== $versions; ${cuda:-no CUDA}; preflight and install took $(elapsed) s"
command -v nvidia-smi >/dev/null && [ -n "$cuda" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
{
  echo "# GPU check summary, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "${cuda:-no CUDA (a CPU rehearsal: smoke runs, numbers meaningless)}; $versions; wheels from $wheels"
  echo "Stages and budgets (s): kernels ${budget_s[kernels]}, student ${budget_s[student]}, step ${budget_s[step]}, loss the rest"
} > "$summary"

# ---- stages -------------------------------------------------------------------------------------------------
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
cd "$repo" || exit 3
failed=()

run_stage() {  # run_stage NAME BUDGET_S CMD...: figure lines into the summary as they come; a cut stage is named
  local name=$1 limit=$2 rc line begun
  shift 2
  begun=$(date +%s)
  echo "== stage $name (at $(elapsed) s, budget $limit s): $*"
  printf '\n## %s (budget %s s)\n\n' "$name" "$limit" >> "$summary"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$out/$name.log" | while IFS= read -r line; do
    printf '%s\n' "$line"
    case $line in "|"*|"{"*|iteration*|"kd loss"*|peak*|teacher*|"no CUDA"*|*passed*|*failed*|*error*)
      printf '%s\n' "$line" >> "$summary";; esac
  done
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "== stage $name CUT: it hit its own $limit s timeout (the other stages go on)" | tee -a "$summary"
    failed+=("$name (cut at $limit s)")
  elif [ "$rc" -ne 0 ]; then
    echo "== stage $name FAILED with status $rc after $(($(date +%s) - begun)) s" | tee -a "$summary"
    failed+=("$name (status $rc)")
  else
    echo "== stage $name ok in $(($(date +%s) - begun)) s" | tee -a "$summary"
  fi
}

if [ -n "$cuda" ]; then
  run_stage kernels "${budget_s[kernels]}" "$vpy" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    tests/test_kernels_compile.py tests/test_loss_triton.py
  run_stage student "${budget_s[student]}" "$vpy" tools/gpu_student_check.py
  run_stage step "${budget_s[step]}" "$vpy" tools/bench_step.py --device cuda --hidden 2880 --vocab 201088 \
    --heads 40 --groups 8 --ffn 2880 --seq-lengths 2048,8192,32768 --micro-batch 4 --budget-s 100 \
    --out "$out/step_gpu.md"
  left=$((total_s - $(elapsed)))
  [ "$left" -ge "${budget_s[loss]}" ] || left=${budget_s[loss]}
  run_stage loss "$left" "$vpy" tools/bench_loss_gpu.py --budget-s $((left - 40)) --out "$out/loss_gpu.md"
else
  echo "no CUDA: every stage runs its CPU smoke instead of the GPU run (numbers meaningless)" | tee -a "$summary"
  run_stage kernels "${budget_s[kernels]}" "$vpy" -m pytest -q -p no:cacheprovider --collect-only \
    tests/test_kernels.py tests/test_kernels_compile.py tests/test_loss_triton.py
  run_stage student "${budget_s[student]}" "$vpy" tools/gpu_student_check.py --dry-run
  run_stage step "${budget_s[step]}" "$vpy" tools/bench_step.py --device cpu --hidden 64 --vocab 512 --heads 4 \
    --groups 2 --ffn 128 --seq-lengths 64 --micro-batch 1 --variants megatron_peer,fused_recompute \
    --out "$out/step_gpu.md"
  run_stage loss "${budget_s[loss]}" "$vpy" tools/bench_loss_gpu.py --cpu-smoke --out "$out/loss_gpu.md"
fi
echo "== done in $(elapsed) s; results in $out${failed[*]:+; not ok: ${failed[*]}}" | tee -a "$summary"
[ ${#failed[@]} -eq 0 ]
