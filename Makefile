# Two entry points: `make demo` (the CPU demo, end to end) and `make test` (the test suite). Each installs what it
# needs into .venv first. On these CPU machines `torch==2.13.0` is a local CPU wheel; install it before the project,
# or a bare `torch` requirement pulls a multi-GB CUDA build. On a GPU machine set TORCH_SPEC to your CUDA torch.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test plan-example clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) -m adapter.demo --out demo-out

test: setup
	$(VENV)/bin/ruff check adapter tests bench launch
	$(VENV)/bin/mypy
	# both on two pytest workers. The multi-process tests go a file to a worker (--dist loadfile: a module's shared
	# fixtures are built once): one at a time they left a core idle 37% of the time (a rank waiting in a collective,
	# a launched job importing), and took 1.6x as long (900 s against 556 s, 2026-12-05)
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --durations=10 tests/unit
	DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25 \
		tests --ignore=tests/unit

plan-example: setup
	$(VENV)/bin/nd-adapter plan configs/llama-3.1-8b-hsdp-tp.yaml --nodes 2 --gpus-per-node 8

clean:
	rm -rf demo-out .pytest_cache .mypy_cache
