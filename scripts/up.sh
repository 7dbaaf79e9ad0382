#!/usr/bin/env bash
# One command to try qwen-serve: install into .venv if needed, then run all four services on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
QWENSERVE_EXTRAS=${QWENSERVE_EXTRAS:-dev} bash scripts/setup.sh
exec .venv/bin/qwen-serve up "$@"
