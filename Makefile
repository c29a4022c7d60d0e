# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-all bench lint mutants mutmut clean

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
test: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow and not serial" -n 2 --dist loadfile --durations=15
	$(PY) -m pytest -q -x -m "serial and not slow" --durations=5 $(SERIAL_FILES)

test-all: $(STAMP)
	$(PY) -m pytest -q -x --durations=25

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]' || echo "bench: torchft did not install; its part will say why"
	$(PY) bench/run_all.py $(if $(QUICK),--quick,)

# named mutations of src/, each must turn its catching tests red (bench/mutants.py; ONLY="a b" for some)
mutants: $(STAMP)
	$(PY) bench/mutants.py $(if $(ONLY),--only $(ONLY),)
	$(if $(TOOL),$(MAKE) mutmut,)

# mutmut over the pure-logic modules ([tool.mutmut] in pyproject.toml); work files in mutants/
mutmut: $(STAMP)
	$(PY) -m pip install -q 'mutmut>=3.3,<4'
	rm -rf mutants
	$(PY) -m mutmut run --max-children 2
	$(PY) bench/mutmut_shares.py

lint: $(STAMP)
	$(PY) -m pip install -q ruff mypy
	$(PY) -m ruff check src tests bench examples
	$(PY) -m mypy src

clean:
	rm -rf runs .pytest_cache mutants
