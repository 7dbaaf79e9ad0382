#!/usr/bin/env bash
# The test command: installs what the tests need, then lints and runs the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/tokenizer -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python scripts/gen_proto.py --check
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
