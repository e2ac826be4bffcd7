.PHONY: setup demo test bench
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m midlayer demo

# the suite in parallel processes (pytest-xdist), one per core up to 4 (each takes its share of the cores for
# PyTorch's threads: tests/conftest.py); TEST_WORKERS=0 runs it in this one process
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS)

bench: setup
	.venv/bin/python -m midlayer bench train
