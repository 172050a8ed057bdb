# alpac: `make test` and `make demo` set up everything they need in .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench testdata clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

DEMO_MODEL ?= testdata/models/mlp_train.hlo

demo: $(STAMP)
	$(VENV)/bin/alpac inspect $(DEMO_MODEL)
	$(VENV)/bin/alpac compile $(DEMO_MODEL) -o demo-plan --timings
	$(VENV)/bin/alpac explain demo-plan --limit 10
	$(VENV)/bin/alpa-run demo-plan --check --iters 3 --report demo-plan.report.json -- np 8

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

testdata: $(STAMP)
	$(PY) testdata/generate.py

clean:
	rm -rf $(VENV) *.egg-info
