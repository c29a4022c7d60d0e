# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-oldest-torch test-all bench lint mutants mutmut clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/phoenixft demo

# two pytest-xdist workers, a test file each at a time (module fixtures stay one per file; reference runs are
# shared: tests/conftest.py); then, alone, the tests marked `serial` (docs/testing.md says which and why), collected
# from the files that mark any (collecting the whole suite again costs the second command seconds of CPU)
SERIAL_FILES = $(shell grep -rl --include='*.py' 'mark\.serial' tests | sort)
define suite
	$(1) -m pytest -q -x -m "not slow and not serial" -n 2 --dist loadfile --durations=15
	$(1) -m pytest -q -x -m "serial and not slow" --durations=5 $(SERIAL_FILES)
endef
test: $(STAMP)
	$(call suite,$(PY))

# the same suite on the oldest torch the package accepts (pyproject.toml's lower bound), in a venv of its own:
# PyPI's torch 2.11.0 is a CUDA build (about 4 GB with its NVIDIA libraries) and runs the suite on the CPU
OLDEST_TORCH ?= 2.11.0
VENV_OLDEST ?= .venv-torch-$(OLDEST_TORCH)
test-oldest-torch:
	test -x $(VENV_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_OLDEST)
	$(VENV_OLDEST)/bin/python -m pip install -q torch==$(OLDEST_TORCH)
	$(VENV_OLDEST)/bin/python -m pip install -q -e '.[test]'
	$(call suite,$(VENV_OLDEST)/bin/python)

test-all: $(STAMP)
	$(PY) -m pytest -q -x --durations=25

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]' || echo "bench: torchft did not install; its part will say why"
	$(PY) bench/run_all.py $(if $(QUICK),--quick,)

# named mutations of src/, each must turn its catching tests red (bench/mutants.py; ONLY="a b" for some)
mutants: $(STAMP)
	$(PY) bench/mutants.py $(if $(ONLY),--only $(ONLY),)
	$(if $(TOOL),$(MAKE) mutmut,)

# mutmut over the pure-logic and security modules ([tool.mutmut] in pyproject.toml); work files in mutants/.
# On a shared 2-core machine: one module at a time, one child (make mutmut CHILDREN=1 MUTANTS='phoenixft.controlplane.values*')
mutmut: $(STAMP)
	$(PY) -m pip install -q 'mutmut>=3.3,<4'
	rm -rf mutants
	$(PY) -m mutmut run --max-children $(or $(CHILDREN),2) $(MUTANTS)
	$(PY) bench/mutmut_shares.py

lint: $(STAMP)
	$(PY) -m pip install -q ruff==0.17.6 mypy==2.4.1
	$(PY) -m ruff check src tests bench examples
	$(PY) -m mypy src

clean:
	rm -rf runs .pytest_cache mutants
