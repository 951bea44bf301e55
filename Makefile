PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# one worker per test file: a file's shared fits (module fixtures, cached fits) are computed
# once, not once in each worker (a cold-cache run: 630 s against 770 s with tests spread one by one)
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile tests

# the benchmark also installs the optional `bench` extra (scikit-learn for its real data set,
# matplotlib for its PNGs)
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(PY) -m blrppl.bench --out docs
	$(PY) -m blrppl.bench.deep --out docs
	$(PY) -m blrppl.bench.mixtures --out docs
	$(PY) -m blrppl.bench.sharding --out docs

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
