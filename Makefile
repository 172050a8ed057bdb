# alpac: `make test` and `make demo` set up everything they need in .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench zoo testdata zoo-generate zoo-check clean

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
	$(VENV)/bin/alpa-run demo-plan --check --iters 3 --report demo-plan.report.json \
		--trace demo-plan.trace.json -- np 8
	$(VENV)/bin/alpac explain demo-plan --against demo-plan.report.json \
		--trace demo-plan.predicted.json

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(PY) $$f || exit 1; done

# every zoo program in every configuration + the corpus modules -> benchmarks/results/zoo.md
zoo: $(STAMP)
	$(PY) testdata/zoo/run.py

testdata: $(STAMP)
	$(PY) testdata/generate.py

# The front-end zoo (testdata/zoo/): its generator needs transformers/flax/optax, TensorFlow and
# PyTorch/XLA, pinned in the `zoo` extra, in a venv of its own. The outputs are committed.
ZOO_VENV := .zoo-venv
ZOO_STAMP := $(ZOO_VENV)/.installed

$(ZOO_STAMP): pyproject.toml
	test -x $(ZOO_VENV)/bin/python || $(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['zoo']))" > $(ZOO_VENV)/zoo-requirements.txt
	$(ZOO_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -r $(ZOO_VENV)/zoo-requirements.txt
	touch $(ZOO_STAMP)

# make zoo-generate [ZOO_PROGRAMS="hf_gpt2_train ..."]   (default: every program; slow)
zoo-generate: $(ZOO_STAMP) $(STAMP)
	$(ZOO_VENV)/bin/python testdata/zoo/generate.py $(ZOO_PROGRAMS)
	$(PY) testdata/zoo/opcode_programs.py

# the committed reference data against .venv's jaxlib
zoo-check: $(STAMP)
	$(PY) testdata/zoo/check_refs.py $(ZOO_PROGRAMS)

clean:
	rm -rf $(VENV) *.egg-info
