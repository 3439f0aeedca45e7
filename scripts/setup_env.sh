#!/usr/bin/env bash
# Create .venv with the pinned requirements (once), then print the python to use.
# Set PYTHON=/path/to/python to use an existing environment instead (e.g. a GPU machine's
# CUDA torch, with kernels==0.17.2 installed).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  echo "$PYTHON"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv >&2
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt >&2
echo "$PWD/.venv/bin/python"
