#!/usr/bin/env bash
# The project's one entry point on a fresh machine: sets up (or reuses) the virtual environment, then runs
#   bash tools/run.sh demo [ARGS...]   the main job: the end-to-end distillation demo on its embedded default
#   bash tools/run.sh test [ARGS...]   the whole test suite (pytest ARGS...)
#   bash tools/run.sh setup            only the set-up
# The environment lives in $KD_VENV (default: .venv at the repository root). Set-up is skipped when nothing it
# depends on changed since the last successful one (a stamp file holds their hash).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${KD_VENV:-$repo/.venv}
command=${1:-}
case "$command" in
  demo|test|setup) shift ;;
  *) echo "usage: bash tools/run.sh {demo|test|setup} [ARGS...]" >&2; exit 2 ;;
esac

python_ok() {  # a Python >= 3.12 that can create virtual environments
  "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
  local candidate
  for candidate in "${KD_PYTHON:-}" python3.12 \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 python3.13 \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 python3; do
    [ -n "$candidate" ] || continue
    candidate=$(command -v "$candidate" 2>/dev/null) || continue
    if python_ok "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

setup() {
  local stamp="$venv/.megatron_kd_plugin-setup" want
  want=$(cat "$repo/pyproject.toml" "$repo/tools/constraints.txt" "$repo/tools/run.sh" \
             "$repo/tools/install_te_bridge.sh" | sha256sum | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  if [ ! -x "$venv/bin/python" ]; then
    local python
    if ! python=$(find_python); then
      cat >&2 <<'MSG'
error: megatron_kd_plugin needs Python >= 3.12 (megatron-core 0.19 and megatron-bridge 0.6 require it), and none
was found on PATH (python3.12, python3.13, python3) or among pyenv's versions. Install one, e.g.
    pyenv install 3.12        (or: apt-get install python3.12 python3.12-venv)
or point KD_PYTHON at it, then run this command again. Nothing was changed.
MSG
      exit 1
    fi
    echo "[setup] creating $venv with $python ($("$python" --version 2>&1))"
    "$python" -m venv "$venv"
  fi
  local start=$SECONDS
  echo "[setup] installing megatron_kd_plugin and its dependencies; the first time on a 2-core machine this takes"
  echo "[setup] ~10-15 min, most of it compiling Transformer Engine's C++ extension (step 2/4 below, ~10 min)"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -c "$repo/tools/constraints.txt" -e "$repo[test,demo,s3]"
  bash "$repo/tools/install_te_bridge.sh" "$venv/bin/python"
  echo "$want" > "$stamp"
  echo "[setup] done in $((SECONDS - start)) s"
}

setup
cd "$repo"
case "$command" in
  demo) exec "$venv/bin/python" -m megatron_kd_plugin demo "$@" ;;
  test) exec "$venv/bin/python" -m pytest tests "$@" ;;
  setup) ;;
esac
