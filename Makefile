.PHONY: setup demo test bench
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m midlayer demo

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python -m midlayer bench train
