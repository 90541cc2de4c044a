# The two commands. Both set up .venv on a fresh machine.
PROMPT ?= Write a Python function that checks whether a number is prime.
PYTEST_ARGS ?=
# test files spread over this many processes (JAX's compiles are single-threaded)
PYTEST_WORKERS ?= 2

.PHONY: demo test test-all lint

demo:  ## generate an answer with the embedded default model (SmolLM2-135M-Instruct)
	@scripts/setup_venv.sh
	.venv/bin/jaxspec generate "$(PROMPT)"

test:  ## lint, format check and the default (fast) test suite
	@scripts/setup_venv.sh test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)

test-all:  ## every test, slow ones included
	@$(MAKE) test PYTEST_ARGS="-m 'not gpu'"
