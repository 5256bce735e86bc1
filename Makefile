# Two commands: `make test` and `make run`. Both set up .venv on their own.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.chunkline-installed
PIPELINE ?= pipelines/toy_world
ARGS ?=
LIVEKIT ?=
# The LiveKit server is built from its Go module (never downloaded prebuilt) into the git-ignored .tools/.
LIVEKIT_VERSION ?= v1.13.5
TOOLS := .tools
LIVEKIT_SERVER := $(TOOLS)/livekit-server

.PHONY: test run bench explore diagrams clean livekit-server

# A new .venv takes about 5.5 GB (torch with its CUDA libraries); say so before pip fails halfway with ENOSPC.
NEED_GB ?= 7
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -c 'import shutil, sys; free = shutil.disk_usage(".").free / 2**30; \
		sys.exit(0 if free >= $(NEED_GB) else f"make: a new $(VENV) needs about $(NEED_GB) GB of free disk here; {free:.1f} GB is free (free some space, or NEED_GB=0 to try anyway)")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	@if command -v go >/dev/null 2>&1; then $(MAKE) --no-print-directory livekit-server; \
	else echo "Go not found: the LiveKit tests will skip (install Go, then make livekit-server)"; fi
	$(PY) -m pytest

# Reused when the pinned version is already built; `go install` refuses modules with replace directives,
# so the pin must be a release without them (v1.13.2 to v1.13.5).
livekit-server:
	@if $(LIVEKIT_SERVER) --version 2>/dev/null | grep -qx "livekit-server version $(LIVEKIT_VERSION:v%=%)"; then \
		echo "$(LIVEKIT_SERVER) $(LIVEKIT_VERSION) is already built"; \
	elif ! command -v go >/dev/null 2>&1; then \
		echo "make livekit-server: Go is not installed; install Go >= 1.26 to build LiveKit $(LIVEKIT_VERSION)" >&2; exit 1; \
	else \
		mkdir -p $(TOOLS)/gobin && \
		CGO_ENABLED=0 GOBIN="$(abspath $(TOOLS))/gobin" go install -trimpath \
			github.com/livekit/livekit-server/cmd/server@$(LIVEKIT_VERSION) && \
		mv -f $(TOOLS)/gobin/server $(LIVEKIT_SERVER) && rmdir $(TOOLS)/gobin && \
		echo "built $(LIVEKIT_SERVER) $(LIVEKIT_VERSION)"; \
	fi

# `make run LIVEKIT=1`: the same, with a LiveKit server of its own (built if needed) as the transport.
run: $(STAMP)
ifeq ($(LIVEKIT),1)
	@$(MAKE) --no-print-directory livekit-server
	$(PY) -m server.livekit_local $(PIPELINE) $(ARGS)
else
	$(VENV)/bin/chunkline stream-serve $(PIPELINE) $(ARGS)
endif

bench: $(STAMP)
	$(PY) -m bench.engine

explore: $(STAMP)
	$(PY) -m states.explore

diagrams: $(STAMP)
	$(PY) -m states.diagrams

clean:
	rm -rf $(VENV) *.egg-info .hypothesis
