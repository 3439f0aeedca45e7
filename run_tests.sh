#!/usr/bin/env bash
# Run the test suite: on the GPU at GPU sizes if there is one, else on CPU through Triton's
# interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at small sizes. Extra arguments go
# to pytest (e.g. -k causal, -x).
set -euo pipefail
cd "$(dirname "$0")"
python=$(scripts/setup_env.sh)
workers=$("$python" -c "import os; print(min(8, os.cpu_count() or 1))")
exec "$python" -m pytest tests -n "$workers" -q -p no:cacheprovider "$@"
