# Ballast: the two set-up commands for a fresh machine (Python 3.11 + pip), and a few more.
#   make up     venv + install + tiny model + local mesh + one streamed answer
#   make test   venv + install + every test (starts its own etcd, Redis and Kafka broker)

VENV ?= .venv
PY := $(VENV)/bin/python
BALLAST := $(VENV)/bin/ballast
STAMP := $(VENV)/.installed
MODEL_DIR ?= .ballast/models/tiny

.PHONY: install up down status chat test protos bench-overhead clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject (CPU build); vLLM is the separate `gpu` extra, never installed here.
	$(PY) -m pip install --quiet -e '.[torch,local,dev]'
	touch $(STAMP)

install: $(STAMP)

up: install
	$(BALLAST) model build-tiny $(MODEL_DIR)
	$(BALLAST) up --model-dir $(MODEL_DIR)
	$(BALLAST) chat "Hello! Can you help me with my order?"
	@echo
	@echo "The mesh keeps running in the background:"
	@echo "  $(BALLAST) chat \"your question\"   stream another answer"
	@echo "  $(BALLAST) status                  workers, load and leases from etcd"
	@echo "  make down                           stop everything"

down:
	$(BALLAST) down

status:
	$(BALLAST) status

# Tiers run as separate pytest processes: unit (pure logic), component (real servers on
# port 0 in one process), then integration (every service a subprocess) and the GPU suites
# (which skip, saying why, without a GPU).
test: install
	$(PY) scripts/gen_protos.py --check
	$(PY) -m pytest -q tests/unit
	$(PY) -m pytest -q --durations=10 tests/component
	$(PY) -m pytest -q -rs --durations=15 tests/integration tests/gpu

protos: install
	$(PY) scripts/gen_protos.py

bench-overhead: install
	$(BALLAST) bench overhead
bench-backfill: install
	$(PY) -m bench.backfill

clean: down
	rm -rf .ballast
