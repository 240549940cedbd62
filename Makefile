PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint demo test bench coverage coverage-digits clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,test]'
	touch $(STAMP)

install: $(STAMP)

# ruff: lint and format, configured in pyproject.toml; .ci/run runs it before the suite (seconds)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(PY) -m exporter.standins.demo

# One pytest-xdist worker per core (at most 4), each kept to its core by tests/conftest.py; a test file (or the
# files sharing the android build) runs whole on one worker, the slowest files first. TEST_WORKERS=0: one process.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --maxprocesses 4 --dist loadgroup --no-loadscope-reorder

bench: $(STAMP)
	$(PY) -m exporter.bench

# docs/coverage.md: the torchvision sweep (random weights, every artifact of every target). Resumable; nice'd
# because it runs for hours. The whole of torchvision: make coverage COVERAGE_ARGS=
COVERAGE_ARGS ?= --one-per-builder --task classification --task segmentation --max-params 30000000 --time-limit 900
coverage: $(STAMP)
	nice -n 10 $(VENV)/bin/exporter coverage $(COVERAGE_ARGS) --out docs

# docs/coverage-digits.md: the trained tier (each classifier trained on the digits, judged on labeled digits).
# Training dominates and grows with the weight's FLOPs: hours for the small CNNs on a 2-core host.
DIGITS_ARGS ?= --one-per-builder --task classification --max-params 12000000 --target android --target jetson --time-limit 3600
coverage-digits: $(STAMP)
	nice -n 10 $(VENV)/bin/exporter coverage --weights digits $(DIGITS_ARGS) --out docs

clean:
	rm -rf $(VENV) exports .cache
