#!/usr/bin/env bash
# Set up, build the Hub variant, load it through kernels and run forward + backward against
# PyTorch SDPA: on the GPU if there is one, else on CPU through Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")"
python=$(scripts/setup_env.sh)
"$python" scripts/build_variants.py
"$python" scripts/demo.py "$@"
