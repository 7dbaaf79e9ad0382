#!/usr/bin/env bash
# The test command: installs what the tests need, then lints and runs the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/tokenizer -x`, or `-m "not slow"`): then it is one
# pytest run over what they select.
# The suite runs on QWENSERVE_TEST_WORKERS pytest-xdist workers (default 3; 0 runs it in this process): most
# cluster tests wait on processes, timeouts or sleeps: two workers left the two cores idle a fifth of the time,
# three keep them busy. `--dist loadgroup` keeps each module
# (and the groups tests/conftest.py names) on one worker, so its shared clusters start once.
# Without arguments it runs in two parts: everything but the `exclusive` tests on the workers, then those one at a
# time in this process (tests/conftest.py says which and why); it fails if either part does.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python scripts/gen_proto.py --check
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25)
WORKERS=(-n "${QWENSERVE_TEST_WORKERS:-3}" --dist loadgroup)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "${WORKERS[@]}" "$@"
fi
shared=0
"${PYTEST[@]}" "${WORKERS[@]}" -m "not exclusive" || shared=$?
alone=0
# Named by path as well, so that this run imports only their modules.
mapfile -t EXCLUSIVE < <(.venv/bin/python -c \
  "from tests.conftest import EXCLUSIVE_TESTS; print(*('tests/' + p for p in EXCLUSIVE_TESTS), sep='\n')")
"${PYTEST[@]}" -n 0 -m exclusive "${EXCLUSIVE[@]}" || alone=$?
echo "make test: the tests beside each other exited $shared, the exclusive ones $alone"
[ "$shared" -eq 0 ] && [ "$alone" -eq 0 ]
