#!/usr/bin/env bash
# Run the test suite: on the GPU at GPU sizes if there is one, else on CPU through Triton's
# interpreter (TRITON_INTERPRET=1, set by tests/conftest.py) at small sizes. Extra arguments go
# to pytest (e.g. -k causal, -x); an argument that names an existing file or folder (relative to
# the repository root, optionally with a ::test id) runs that instead of the whole tests/ folder:
# ./run_tests.sh tests/test_errors.py -x
set -euo pipefail
cd "$(dirname "$0")"
python=$(scripts/setup_env.sh)
workers=$("$python" -c "import os; print(min(8, os.cpu_count() or 1))")
targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done
exec "$python" -m pytest ${targets[@]+"${targets[@]}"} -n "$workers" -q -p no:cacheprovider "$@"
