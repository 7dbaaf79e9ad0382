.PHONY: setup test proto lint up bench

setup:
	bash scripts/setup.sh

test:
	bash scripts/test.sh

proto:
	.venv/bin/python scripts/gen_proto.py

lint:
	.venv/bin/ruff check .

up:
	bash scripts/up.sh
