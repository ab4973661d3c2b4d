PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
DISTS := libs/core libs/service-main libs/proto libs/ledger libs/transfer services/weight-broker services/trainer services/rollout services/dashboard services/controller

# The distributions' source roots, so that tools which read files see the one `furlong` namespace.
SOURCE_PATH := $(subst $(eval) ,:,$(DISTS))

.PHONY: setup proto proto-check lint test example example-math-word clean

$(VENV)/.installed: requirements.txt $(foreach d,$(DISTS),$(d)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps $(foreach d,$(DISTS),-e $(d))
	touch $@

setup: $(VENV)/.installed

proto: setup
	$(PY) tools/proto_gen.py

proto-check: setup
	$(PY) tools/proto_gen.py --check

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=$(SOURCE_PATH) $(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy -p furlong.core -p furlong.service_main -p furlong.rpc -p furlong.ledger -p furlong.transfer -p furlong.weight_broker -p furlong.trainer -p furlong.rollout -p furlong.dashboard -p furlong.controller
	$(PY) tools/deps_check.py

test: setup
	$(PY) -m pytest -q

example: setup
	$(VENV)/bin/furlong run examples/addition/run.yaml --out runs/addition

example-math-word: setup
	$(VENV)/bin/furlong run examples/math-word/run.yaml --out runs/math-word

clean:
	rm -rf $(VENV) runs .furlong
