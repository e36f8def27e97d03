# The two commands of the README:  `make run` (main job) and `make test` (tests).
# Both create .venv with every dependency on first use (Python 3.11 is all they need).
PY      ?= python3.11
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup run test test-all bench sweep ablation clean lock docs report lint typecheck pki nettools

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found; run make PY=/path/to/python3.11"; exit 1; }
	@test -x $(VPY) || $(PY) -m venv $(VENV) || { rm -rf $(VENV); \
	  $(PY) -m pip install -q --user uv && $(PY) -m uv venv -q --seed --python $(PY) $(VENV); }
	$(VPY) -m pip install -q --upgrade pip uv
	$(VPY) -m uv pip install -q --python $(VPY) -r requirements.lock
	$(VPY) -m uv pip install -q --python $(VPY) --no-deps -e .
	@rm -f $(VENV)/.installed-*; touch $(STAMP)
	@$(MAKE) -s nettools

nettools:                       ## nftables for the emulated network's packet loss (as root, Debian)
	@command -v nft >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q nftables >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nftables >/dev/null 2>&1; }; } \
	  && echo "installed nftables" || echo "note: nftables not installed (needs root and apt-get): the emulated network cannot drop packets"; }

setup: $(STAMP)

run: setup                      ## main job: train the online policy, evaluate it on held-out traces
	$(VPY) train.py $(ARGS)

test: setup                     ## fast tests (what CI runs)
	$(VPY) -m pytest -q $(ARGS)

test-all: setup                 ## fast and slow tests
	$(VPY) -m pytest -q -m "slow or not slow" $(ARGS)

sweep: setup                    ## Figs. 5-8 reproduction at CERN scale
	$(VPY) sweep.py $(ARGS)

STUDY    ?= online_ablation
VARIANTS ?= base,no_forecaster,no_per,no_td3,no_demos,last_outcome_only,load_only,switching_x10
SEEDS    ?= 0,1,2,3,4
ablation: setup                 ## online policy ablation: a Hydra multirun in MLflow, then its table
	$(VPY) train.py -m +ablation=$(VARIANTS) seed=$(SEEDS) +tags.study=$(STUDY) progress=false $(ARGS)
	$(VPY) ablation.py study=$(STUDY)

bench: setup                    ## benchmarks (results: bench/results/, docs/benchmarks.md)
	$(VPY) bench/run_all.py $(ARGS)

pki: setup                      ## development CA, identities and bundle-signing key (~/.cache/smart-dsmd/pki)
	$(VPY) -m security.pki create $(ARGS)

lock:                           ## re-resolve requirements.lock from pyproject.toml
	$(VPY) -m uv pip compile -q pyproject.toml --all-extras --python-version 3.11 -o requirements.lock

docs: setup                     ## the documentation site (site/index.html), warnings are errors
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

report: setup                   ## reproduction report and benchmarks page from result files
	$(VPY) report.py $(ARGS)

lint: setup                     ## ruff
	$(VENV)/bin/ruff check .

typecheck: setup                ## mypy on envs/ and serving/
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) outputs site .pytest_cache .hypothesis
