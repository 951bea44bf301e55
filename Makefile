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

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

# the benchmark also installs the optional `bench` extra (scikit-learn for its real data set,
# matplotlib for its PNGs)
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[test,bench]"
	$(PY) -m blrppl.bench --out docs

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
