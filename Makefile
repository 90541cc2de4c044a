# The two commands. Both set up .venv on a fresh machine.
PROMPT ?= Write a Python function that checks whether a number is prime.
PYTEST_ARGS ?=
# test files spread over this many processes (JAX's compiles are single-threaded)
PYTEST_WORKERS ?= 2

.PHONY: demo test test-all lint

demo:  ## generate an answer with the embedded default model (SmolLM2-135M-Instruct)
	@scripts/setup_venv.sh
	.venv/bin/jaxspec generate "$(PROMPT)"

# A test whose worker process crashes runs once more on a fresh worker; a failed assertion never
# does. XLA's CPU compiler has segfaulted inside a compile now and then under two xdist workers
# (seen in tests/test_tree_engine.py and tests/test_bit_exact.py), which without the re-run
# fails the whole suite for no fault of the test. --dist worksteal: each worker starts on a
# contiguous share of the tests (a file's compiled programs stay in one process) and an idle
# worker takes tests from the busy one; loadfile and loadgroup cannot re-queue a crashed test.
test:  ## lint, format check and the default (fast) test suite
	@scripts/setup_venv.sh test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=25 \
	  --reruns 1 --only-rerun "crashed while running" $(PYTEST_ARGS)

test-all:  ## every test, slow ones included
	@$(MAKE) test PYTEST_ARGS="-m 'not gpu'"
