#!/usr/bin/env bash
# The test command: installs what the tests need, then lints and runs the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/tokenizer -x`, or `-m "not slow"`).
# The suite runs on QWENSERVE_TEST_WORKERS pytest-xdist workers (default 3; 0 runs it in this process): most
# cluster tests wait on processes, timeouts or sleeps: two workers left the two cores idle a fifth of the time,
# three keep them busy. `--dist loadgroup` keeps each module
# (and the groups tests/conftest.py names) on one worker, so its shared clusters start once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python scripts/gen_proto.py --check
# The test processes' own PyTorch work (transformers references, the tensors tests compare) on one thread each:
# three workers' two-thread OpenMP regions on two cores wait on each other's scheduling. Engines set their threads
# themselves (--threads, EngineConfig.num_threads; default: every core), so this changes none of theirs.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every test process's OpenMP threads (clusters' engines included) sleep at once when they wait, rather than spin
# for a core that the suite's other processes need: speed is measured in bench/, never here.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -n "${QWENSERVE_TEST_WORKERS:-3}" --dist loadgroup "$@"
