.PHONY: setup test check proto lint up bench

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh

# Lint and the unit tier: every test that starts no process and is not marked slow (tests/conftest.py).
check:
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "not cluster and not slow"

proto:
	.venv/bin/python scripts/gen_proto.py

lint:
	.venv/bin/ruff check .

up:
	bash scripts/up.sh
