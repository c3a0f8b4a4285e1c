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

# two workers (pytest-xdist): a file with module-scoped servers or orchestrators runs whole on one of them, every
# other test goes to whichever worker is free (tests/conftest.py, pytest_xdist_make_scheduler). langsmith (a
# dependency of the frameworks extra) registers a pytest plugin the suite does not use; loading it costs each
# pytest process ~2.5 s of CPU (its modules imported and assertion-rewritten). Bytecode is written even where
# PYTHONDONTWRITEBYTECODE is set: the suite starts hundreds of Python processes (Ray workers, servers, examples),
# and without it each compiles every capsulert module it imports afresh (~10% of a Ray-heavy test's CPU)
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -p no:langsmith_plugin -m "not gpu" -n 2 tests

# the docs site into site/; strict (mkdocs.yml): a broken link or a page missing from the nav fails the build
docs: $(STAMP)
	$(VENV)/bin/mkdocs build

bench: $(STAMP)
	$(PY) bench/capsules.py --device cpu
	$(PY) bench/working_set.py --quick
	$(PY) bench/orchestrator.py --quick

clean:
	rm -rf $(VENV)
