PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench coverage clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m exporter.standins.demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=25

bench: $(STAMP)
	$(PY) -m exporter.bench

# docs/coverage.md: the torchvision sweep (random weights, every artifact of every target). Resumable; nice'd
# because it runs for hours. The whole of torchvision: make coverage COVERAGE_ARGS=
COVERAGE_ARGS ?= --one-per-builder --task classification --task segmentation --max-params 30000000 --time-limit 900
coverage: $(STAMP)
	nice -n 10 $(VENV)/bin/exporter coverage $(COVERAGE_ARGS) --out docs

clean:
	rm -rf $(VENV) exports .cache
