#!/usr/bin/env bash
# The prepared GPU check, for one lent H200 (no network; its python3 is itself a venv holding torch): ~8 minutes.
#   bash tools/gpu_check.sh --download    where the package index is reachable: fetch tools/gpu_wheels.txt's wheels
#                                         (CPython $wheel_python, Linux x86_64) into tools/wheels/ (git-ignored)
#   bash tools/gpu_check.sh               on the GPU machine, with tools/wheels/ carried beside the checkout
#   bash tools/gpu_check.sh --preflight   the preflight alone (seconds)
#   bash tools/gpu_check.sh --budget loss=3 [--budget ...]   a stage's budget in seconds (the rehearsal's cut)
#   bash tools/gpu_check.sh --only step,tests                 these stages alone (a rerun of what failed or was cut)
# The exact call on a lent machine (the device tool's run, what it carries, its timeout) is written once, in
# CONTRIBUTING.md ("A lent GPU machine").
#
# Preflight (seconds; any failure is one line naming what is missing, exit 2 or 3):
#   - the interpreter: $KD_PYTHON, else the first of python3, python3.12, python that is >= 3.12 AND holds torch,
#     triton and numpy (the machine's CUDA build; never carried);
#   - every wheel of tools/gpu_wheels.txt present in tools/wheels/ ($KD_GPU_WHEELS), built for that interpreter;
#   - the wheels installed offline with `pip install --no-deps --target` into a fresh folder ($KD_GPU_SITE, default
#     a mktemp folder) put first on PYTHONPATH. No venv: a venv made from a venv sees the base interpreter's
#     site-packages, not the parent venv's (the lent python3 is /opt/torch/.venv/bin/python3), so it would lose
#     torch; --target + PYTHONPATH keeps the interpreter and its site-packages as they are, puts the carried
#     versions ahead of the machine's (typing-extensions for zarr), and reaches child processes (bench_step's);
#   - tools/gpu_preflight.py with that environment: every version the stages need (torch, triton, numpy from the
#     machine at their floors; each carried distribution at its pin and every requirement of theirs met), every
#     stage's imports, the device.
# Stages, in the order of their value, each under its own budget (s; the GPU time each is planned for in brackets);
# each writes its figures to its log and to the summary as they come, so a stage cut by its budget is named with
# what it finished, and the next one starts:
#   correctness  90 [~50]: the Triton fused loss vs the PyTorch fused loss vs float64 at V = 201,088, bf16 and
#                          fp32, both modes, one split of many tiles and many splits, on a top-100 (ghost tail), then
#                          on a head + draws teacher (top-8 + 40 draws, sampled tail) in bf16 (tools/gpu_loss_check.py)
#   loss        150 [~110]: the loss head at H = 2,880, V = 201,088, T = 8K / 32K / 128K, grad_in_forward and
#                          recompute: median / min / max ms of 5 reps, TFLOP/s (6·T·H·V) and the ratio to a measured
#                          bf16 GEMM of the same shape (tools/bench_loss_gpu.py)
#   step        110 [~70]: the whole KD step at V = 201,088, 32K tokens, one process, fused first, then
#                          forward-chunked, Dense, the megatron-core peer (out of memory is a result); each peak next
#                          to the planner's (tools/bench_step.py)
#   student      60 [~40]: a megatron-core student trained by KD under megatron-core's schedule
#                          (tools/gpu_student_check.py)
#   head         60 [~30]: the cache command's fused teacher head at V = 201,088, H = 2,880, T = 32K and 128K
#                          against torch.topk over the full bf16 logits: ms, peak GiB, the same ids
#                          (tools/gpu_teacher_head_check.py)
#   tests        what is left of 480 s, if >= 45: the kernel and Triton-loss tests, compiled
# Preflight ~20 s + 470 s of stage budgets: under 8 minutes when no stage is cut (each gets 5 s more to die).
# Without CUDA (the CPU rehearsal, tests/test_gpu_check.py) every stage runs at tiny shapes on CPU (the Triton
# kernels interpreted): the same scripts and the same paths, figures meaningless.
#
# $OUT (the device tool returns it; else bench_results/gpu_check-<UTC time>/) gets at most 7 files, no folders:
# summary.md (read it first: the preflight, every figure line of every stage, each stage's end: ok / FAILED / CUT)
# and one <stage>.log per stage. Exit status: 0 every stage ok; 1 a stage failed or was cut (never 124: that is the
# whole command's timeout); 2 no usable Python; 3 something missing (named).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheels=${KD_GPU_WHEELS:-$repo/tools/wheels}
wheel_list=$repo/tools/gpu_wheels.txt
wheel_python=${KD_GPU_PYTHON_VERSION:-3.12}   # the lent machine's: Python 3.12.3 (the device notes, KINDS.md)
max_wheel_mib=40                              # the carry limit is 64 MiB with the checkout (~4 MiB)
total_s=480
declare -A budget_s=([correctness]=90 [loss]=150 [step]=110 [student]=60 [head]=60 [tests]=0)

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
  tag=cp${wheel_python//./}
  "$py" -m pip download --no-deps --only-binary=:all: --implementation cp --python-version "$wheel_python" \
    --abi "$tag" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any -d "$wheels" -r "$wheel_list" || exit 3
  files=()
  for pin in $(wheel_pins); do
    file=$(wheel_file "$pin") || { echo "error: no wheel for $pin in $wheels after the download"; exit 3; }
    files+=("$file")
  done
  bytes=$(cat "${files[@]}" | wc -c)
  echo "== ${#files[@]} wheels for CPython $wheel_python, $(awk "BEGIN {printf \"%.1f\", $bytes / 2^20}") MiB in all" \
       "($wheels; the limit is $max_wheel_mib MiB)"
  [ "$bytes" -lt $((max_wheel_mib * 1024 * 1024)) ] ||
    { echo "error: the wheel set exceeds $max_wheel_mib MiB"; exit 3; }
  exit 0
fi
preflight_only=false
only=correctness,loss,step,student,head,tests
stages=${only//,/|}   # the stages as an alternation, for the checks of --budget and --only
while [ $# -gt 0 ]; do
  case $1 in
    --preflight) preflight_only=true;;
    --budget) [[ ${2:-} =~ ^($stages)=[0-9]+$ ]] ||
                { echo "error: --budget takes STAGE=SECONDS (stages: ${!budget_s[*]}), not '${2:-}'"; exit 2; }
              budget_s[${2%%=*}]=${2#*=}; shift;;
    --only) [[ ${2:-} =~ ^(($stages),?)+$ ]] ||
              { echo "error: --only takes STAGE[,STAGE...] (stages: ${!budget_s[*]}), not '${2:-}'"; exit 2; }
            only=$2; shift;;
    *) echo "error: unknown argument '$1' (--download, --preflight, --budget STAGE=SECONDS, --only STAGES)"; exit 2;;
  esac
  shift
done

out=${OUT:-$repo/bench_results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
summary=$out/summary.md
started=$(date +%s)
elapsed() { echo $(($(date +%s) - started)); }
say() { printf '%s\n' "$*" | tee -a "$summary"; }
fail() { say "error: $2"; exit "$1"; }
{ echo "# GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo; } > "$summary"

# ---- preflight ------------------------------------------------------------------------------------------------
has_torch() {  # a Python >= 3.12 that finds torch, triton and numpy
  "$1" -c 'import importlib.util as u, sys
sys.exit(sys.version_info < (3, 12) or any(u.find_spec(m) is None for m in ("torch", "triton", "numpy")))' 2>/dev/null
}
py=
if [ -n "${KD_PYTHON:-}" ]; then
  py=$(command -v "$KD_PYTHON") && has_torch "$py" ||
    fail 2 "KD_PYTHON=$KD_PYTHON is not a Python >= 3.12 holding torch, triton and numpy"
else
  rejected=()
  for candidate in python3 python3.12 python; do
    path=$(command -v "$candidate" 2>/dev/null) || continue
    if has_torch "$path"; then py=$path; break; fi
    rejected+=("$path")
  done
  [ -n "$py" ] ||
    fail 2 "no Python >= 3.12 holding torch, triton and numpy on PATH (tried ${rejected[*]:-none}); set KD_PYTHON"
fi
pytag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
say "preflight: $py ($pytag) holds torch, triton and numpy${rejected:+; passed over (no torch): ${rejected[*]}}"

absent=()
for pin in $(wheel_pins); do wheel_file "$pin" >/dev/null || absent+=("$pin"); done
carry="run 'bash tools/gpu_check.sh --download' where the package index is reachable, then carry tools/wheels"
[ ${#absent[@]} -eq 0 ] || fail 3 "$wheels lacks ${#absent[@]} of the $(wheel_pins | wc -l) wheels of \
tools/gpu_wheels.txt (${absent[*]}): $carry with the checkout (CONTRIBUTING.md, 'A lent GPU machine')"
files=()
for pin in $(wheel_pins); do files+=("$(wheel_file "$pin")"); done
for file in "${files[@]}"; do   # name-version-python-abi-platform.whl: a binary wheel names one interpreter
  IFS=- read -r -a parts <<< "$(basename "$file" .whl)"
  abi=${parts[-2]} python_tag=${parts[-3]}
  [ "$abi" = none ] || [ "$abi" = abi3 ] || [ "$python_tag" = "$pytag" ] ||
    fail 3 "$(basename "$file") is for $python_tag, $py is $pytag: run \
'KD_GPU_PYTHON_VERSION=${pytag:2:1}.${pytag:3} bash tools/gpu_check.sh --download'"
done

site=${KD_GPU_SITE:-$(mktemp -d "${TMPDIR:-/tmp}/kd_gpu_site.XXXXXX")}
"$py" -m pip --version >/dev/null 2>&1 || fail 3 "$py has no pip: the wheels cannot be installed"
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$site" "${files[@]}" 2>&1 | tail -n 5 | tee -a "$summary"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail 3 "the wheels of $wheels do not install offline into $site (pip's words above)"
export PYTHONPATH=$site:$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
cd "$repo" || exit 3
"$py" tools/gpu_preflight.py --site "$site" --wheel-list "$wheel_list" 2> "$site/preflight.err" | tee -a "$summary"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then   # its own findings are above; an unexpected error's words are in stderr
  tail -n 5 "$site/preflight.err" | tee -a "$summary"
  fail 3 "preflight failed (above)"
fi
cuda=false
grep -q '^device: cuda' "$summary" && cuda=true
carried=$(du -sk --exclude=.git --exclude=.venv --exclude=bench_results "$repo" | cut -f1)
say "preflight: done in $(elapsed) s; the checkout with its wheels is $((carried / 1024)) MiB (the carry limit: 64)"
$preflight_only && exit 0

# ---- stages -------------------------------------------------------------------------------------------------
failed=()
run_stage() {  # run_stage NAME CMD...: figure lines ("| ..." and "result: ...") into the summary as they come
  local name=$1 limit=${budget_s[$1]} log=$out/$1.log rc begun finished last
  shift
  [[ ,$only, == *,$name,* ]] || return 0
  begun=$(date +%s)
  say ""
  say "## $name (at $(elapsed) s, budget $limit s)"
  echo "\$ $*" > "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log" | while IFS= read -r line; do
    printf '%s\n' "$line"
    case $line in "|"*|"result:"*) printf '%s\n' "$line" >> "$summary";; esac
  done
  rc=${PIPESTATUS[0]}
  finished=$(grep -c -e '^|' -e '^result:' "$log")
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    last=$(grep -e '^|' -e '^result:' "$log" | tail -n 1)
    say "== stage $name CUT at its $limit s budget, after $finished figure lines${last:+ (the last: $last)}"
    failed+=("$name (cut at $limit s)")
  elif [ "$rc" -ne 0 ]; then
    say "== stage $name FAILED with status $rc after $(($(date +%s) - begun)) s ($name.log: $(tail -n 1 "$log"))"
    failed+=("$name (status $rc)")
  else
    say "== stage $name ok in $(($(date +%s) - begun)) s"
  fi
}

if $cuda; then
  run_stage correctness "$py" tools/gpu_loss_check.py
  run_stage loss "$py" tools/bench_loss_gpu.py --budget-s $((budget_s[loss] - 25))
  run_stage step "$py" tools/bench_step.py --device cuda --hidden 2880 --vocab 201088 --heads 40 --groups 8 \
    --ffn 2880 --seq-lengths 32768 --micro-batch 1 --one-process --budget-s $((budget_s[step] - 25)) \
    --variants fused_grad_in_forward,fused_recompute,forward_chunked,dense,megatron_peer
  run_stage student "$py" tools/gpu_student_check.py
  run_stage head "$py" tools/gpu_teacher_head_check.py
  tests=(tests/test_kernels.py tests/test_loss_triton.py)
else
  say "no CUDA: a CPU rehearsal, every stage at tiny shapes (Triton interpreted); figures meaningless"
  run_stage correctness env TRITON_INTERPRET=1 "$py" tools/gpu_loss_check.py --device cpu --vocab 200 --hidden 16 \
    --tokens 11 --k 8 --chunk-tokens 0,3
  run_stage loss env TRITON_INTERPRET=1 "$py" tools/bench_loss_gpu.py --cpu-smoke
  run_stage step "$py" tools/bench_step.py --device cpu --hidden 32 --vocab 512 --heads 4 --groups 2 --ffn 64 \
    --seq-lengths 64 --k 8 --one-process --variants fused_grad_in_forward,fused_recompute,forward_chunked,dense
  run_stage student "$py" tools/gpu_student_check.py --dry-run
  run_stage head "$py" tools/gpu_teacher_head_check.py --device cpu --tokens 96 --vocab 1000 --hidden 32 --k 8
  tests=(--collect-only tests/test_kernels.py tests/test_loss_triton.py)
fi
left=$((total_s - $(elapsed)))
if [ "${budget_s[tests]}" -eq 0 ] && [ "$left" -lt 45 ]; then   # not set by --budget, and too little left
  say "" && say "== stage tests not run: $left s left of $total_s"
else
  [ "${budget_s[tests]}" -gt 0 ] || budget_s[tests]=$left
  # the machine's own pytest plugins (xdist, cov, benchmark, ...) are built for its pytest, not the carried one
  run_stage tests env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
fi
say ""
say "== done in $(elapsed) s; results in $out${failed[*]:+; not ok: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]
