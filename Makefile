VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/capsulert demo

# two workers, each test file whole on one of them: module-scoped servers and orchestrators start once
test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" -n 2 --dist loadfile tests

# the docs site into site/; strict (mkdocs.yml): a broken link or a page missing from the nav fails the build
docs: $(STAMP)
	$(VENV)/bin/mkdocs build

bench: $(STAMP)
	$(PY) bench/capsules.py --device cpu
	$(PY) bench/working_set.py --quick
	$(PY) bench/orchestrator.py --quick

clean:
	rm -rf $(VENV)
