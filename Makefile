VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/capsulert demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" tests

bench: $(STAMP)
	$(PY) bench/capsules.py --device cpu
	$(PY) bench/working_set.py --quick
	$(PY) bench/orchestrator.py --quick

clean:
	rm -rf $(VENV)
