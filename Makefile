# Two entry points for users: `make deploy SPEC_METHOD=mtp` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SPEC_METHOD ?= mtp
INVENTORY ?= inventory/hosts.yml
# molecule scenarios run by `make test` (longest first: they run two at a time)
SCENARIOS ?= site vllm_build serve cluster model ops bench metrics preflight
# `make test-affected`: the scenarios a change since the merge base of HEAD and BASE touches, uncommitted
# work included (default HEAD: the work not yet committed; BASE=origin/main for a branch)
BASE ?= HEAD
# scratch directory of `make bench-merge`, on the disk to measure (its 16 GB round holds ~42 GB there)
BENCH_DIR ?= /var/tmp
export PATH := $(CURDIR)/$(BIN):$(PATH)
# User variables reach the recipes through the environment ("$$VAR" or scripts/make_run.py), never
# pasted into a shell line: `;`, quotes or `#` in a value cannot run a command or drop --check.
# Each value is taken as written: make does not expand `$(...)` in it (no `$(shell ...)` either).
USER_VARS := SPEC_METHOD INVENTORY ARGS PYTHON SCENARIOS BENCH_DIR BASE
$(foreach v,$(USER_VARS),$(eval override $(v) := $$(value $(v))))
export $(USER_VARS) BIN
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: setup deploy check test test-fast test-affected lint unit contract contract-env molecule testhost-image lock \
        bench-merge bench-runner demo gpu-e2e gpu-model gpu-first-start gpu-dflash gpu-dflash-graph \
        gpu-shared-experts gpu-proxy gpu-head-records tune clean

# --- set-up ----------------------------------------------------------------
$(BIN)/.stamp: requirements.txt
	"$$PYTHON" -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

setup: $(BIN)/.stamp  ## create .venv with every pinned dependency (quick when done)

# --- the main job ----------------------------------------------------------
deploy: setup  ## provision this Spark (or the inventory's) for SPEC_METHOD
	$(BIN)/python scripts/make_run.py deploy

check: setup  ## dry run of deploy (check mode, diff)
	$(BIN)/python scripts/make_run.py check

tune: setup  ## sweep method x K x INT8 head (records profile), leave the fastest lossless one serving
	$(BIN)/python scripts/make_run.py tune

# --- tests -----------------------------------------------------------------
# the timed unit tests alone, then the molecule scenarios in the background with the other unit tests, lint
# and contract beside them at a lower CPU priority (tests/harness/test_all.sh says why); the targets below
# run each suite on its own
test: setup testhost-image  ## everything CI runs
	bash tests/harness/test_all.sh

# the fast gate (docs/testing.md): no molecule, no download; contract only where .venv-vllm is set up
test-fast: setup  ## lint, unit and (where its environment is cached) contract tests: minutes
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory unit
	@if .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then \
	  .venv-vllm/bin/python -m pytest tests/contract -q -m vllm_contract; \
	else \
	  echo "test-fast: contract tests skipped: .venv-vllm has no vLLM (make contract-env sets it up, ~11 GB)"; \
	fi

# the molecule scenarios (of SCENARIOS) whose roles, playbooks or shared files the change touches
test-affected: setup  ## the molecule scenarios a change touches (vs BASE, default HEAD: uncommitted work)
	@scenarios="$$($(BIN)/python tests/harness/affected.py --base "$$BASE" $$SCENARIOS)" || exit $$?; \
	if [ -z "$$scenarios" ]; then \
	  echo "test-affected: the change since $$BASE touches no molecule scenario"; \
	else \
	  echo "test-affected: $$scenarios"; \
	  bash tests/harness/build_testhost_image.sh && bash tests/harness/run_molecule.sh $$scenarios; \
	fi

lint: setup
	$(BIN)/ruff check .
	$(BIN)/yamllint -s .
	$(BIN)/ansible-lint --offline --profile production
	$(BIN)/python -m pytest tests/unit/test_dockerfile.py -q -k hadolint  # templates/Dockerfile.j2, rendered per variant

unit: setup
	$(BIN)/python -m pytest tests/unit -q -m "not vllm_contract"

contract-env:
	bash tests/contract/setup_vllm_env.sh

contract: setup contract-env
	.venv-vllm/bin/python -m pytest tests/contract -q -m vllm_contract

testhost-image:
	bash tests/harness/build_testhost_image.sh

# the vLLM images' locks of the whole Python set (roles/vllm_build/files/locks; needs PyPI, ~10 min cold)
lock: setup  ## refresh the image locks after changing spark_vllm_variants
	$(BIN)/python scripts/image_lock.py

# scenarios run MOLECULE_JOBS at a time (default 2); logs in .cache/molecule/
molecule: setup testhost-image
	bash tests/harness/run_molecule.sh $$SCENARIOS

# --- performance scripts (ratios measured in one run) -----------------------
bench-merge: setup
	$(BIN)/python tests/perf/bench_merge.py --size-gb 8 --double --workdir "$$BENCH_DIR"

bench-runner: setup
	$(BIN)/python tests/perf/bench_runner_overhead.py

demo: setup testhost-image  ## try the whole pipeline without a Spark
	$(BIN)/molecule test -s site
	@echo "report: $(CURDIR)/results/demo/report/report.md"

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .ruff_cache

# --- real GPU (not part of `make test`: CI has no GPU) -------------------------------------------
# On a host with a CUDA GPU where `import vllm` works; see tests/gpu/e2e.py and docs/gpu-e2e/README.md.
gpu-e2e:
	"$$PYTHON" scripts/make_run.py gpu-e2e

# One model catalogue entry (ARGS="--model NAME", default qwen3.6-35b-a3b-fp8) served through our rendered argv,
# baseline and mtp at once, the runner's counters checked against /metrics (tests/gpu/model_entry.py)
gpu-model:
	"$$PYTHON" scripts/make_run.py gpu-model

# First starts with CUDA graphs, FlashInfer, fastsafetensors and EAGLE-3 (tests/gpu/first_start.py);
# ARGS e.g. --cases graph-base,fi-graph-base --flashinfer-cuda-home DIR (tests/gpu/cuda_home.sh makes one)
gpu-first-start:
	"$$PYTHON" scripts/make_run.py gpu-first-start

# DFlash (tiny drafter) and bench.py --concurrency 1,2,4 on vLLM 0.26.0 (tests/gpu/dflash_bench.py), eager
gpu-dflash:
	"$$PYTHON" scripts/make_run.py gpu-dflash

# the CUDA-graph DFlash start against the baseline, no bench (one call of its own on a cold host)
gpu-dflash-graph:
	"$$PYTHON" scripts/make_run.py gpu-dflash-graph

# the serve role's nginx LAN proxy in front of a real vLLM (tests/gpu/proxy_real.py; ARGS="--nginx PATH")
gpu-proxy:
	"$$PYTHON" scripts/make_run.py gpu-proxy

# Negative control (a hybrid with 1/16 shared-expert scales must fail the hybrid check) and vLLM's memory
# reservation against total x utilization (tests/gpu/shared_experts.py); 0.20.0 or 0.26.0
gpu-shared-experts:
	"$$PYTHON" scripts/make_run.py gpu-shared-experts

# the INT8 LM head served with the real 248320 x 3072 head (BF16 beside it, decode tok/s of both) and the
# records profile timed through a proxy (tests/gpu/head_records.py); vLLM 0.20.0, eager, one call
gpu-head-records:
	"$$PYTHON" scripts/make_run.py gpu-head-records
