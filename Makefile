# Both main targets create (once) and reuse a local virtualenv in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# py-libp2p for `dilocod bootstrap --relay` (peers/relay.py): its own site directory, never the venv's
# site-packages, because it pins protobuf < 7 where hivemind's grpcio-tools wants >= 7.
RELAY_SITE := $(VENV)/libp2p-site
RELAY_STAMP := $(RELAY_SITE)/.installed
PEERS ?= 3

.PHONY: test-fast demo test lint venv relay clean bench

venv: $(STAMP) $(RELAY_STAMP)

relay: $(RELAY_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch is pinned to the build that is on local disk; anything else downloads gigabytes.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(RELAY_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --upgrade --target $(RELAY_SITE) libp2p==0.8.1
	touch $(RELAY_STAMP)

demo: $(STAMP)
	$(BIN)/dilocod demo --peers $(PEERS)

test: $(STAMP) $(RELAY_STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

# The unit tier for the edit-test loop (no test marked `integration`: no swarm, no real DHT or server).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not integration" tests

lint: $(STAMP)
	$(BIN)/ruff check dilocod peers proto tests bench
	$(BIN)/ruff format --check dilocod peers proto tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
