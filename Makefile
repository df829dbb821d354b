# Two commands do all the set-up: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CLUSTER_STAMP := $(VENV)/.installed-cluster
COMPAT_STAMP := $(VENV)/.installed-compat
COMPAT_INSTRUCTOR := $(VENV)/compat-instructor
ARGS ?=
REPLICAS ?= 4
# the unit tier: every test without a marker of what makes a test heavy (pyproject.toml lists them)
HEAVY := server or default_model or ray or compat or browser or prometheus or fuzz or slow
# two workers: much of the suite waits on processes, sockets and Ray rather than on the CPU; a file stays on
# one worker, so its module-scoped servers and engines start once; files go out in tests/conftest.py's order
# (heaviest first), not xdist's (most tests first), so that no long file starts last
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
# line coverage of engine/ and gateway/, and its floor (docs/development.md, "Line coverage"): the whole suite measured
# 95.2%; the floor holds for `make test` as CI runs it (no ARGS), not for a run of a part of the suite
COVERAGE_FLOOR := 95
COVERAGE := --cov=engine --cov=gateway --cov-report=term:skip-covered $(if $(ARGS),,--cov-fail-under=$(COVERAGE_FLOOR))

.PHONY: serve serve-cluster test test-fast bench bench-quick bench-peers model clean

# Python writes bytecode at first import and reuses it after, even where PYTHONDONTWRITEBYTECODE is set (as in many
# containers): every server, engine and pytest process would otherwise compile each module it imports from source,
# and pytest would rewrite every test module's asserts on every run.
# uv compiles none at install (pip compiles all of every package: most of it never imported)
export PYTHONDONTWRITEBYTECODE :=

# installs go through uv (scripts/uv_install.py: pip's configuration handed over), which pip installs first
UV_INSTALL := $(PY) scripts/uv_install.py

$(STAMP): pyproject.toml scripts/uv_install.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(UV_INSTALL) $(PY) -q -e '.[test,bench]'
	touch $(STAMP)

# ray[serve], for make test and serve-cluster only: `make serve` neither installs nor imports Ray
$(CLUSTER_STAMP): $(STAMP)
	$(UV_INSTALL) $(PY) -q -e '.[cluster]'
	touch $(CLUSTER_STAMP)

# the client frameworks of tests/gateway/test_client_compat.py, for make test only; instructor in a venv of its own
# (its pins cannot share this venv's openai: tests/compat/instructor.txt)
$(COMPAT_STAMP): $(STAMP) tests/compat/instructor.txt
	$(UV_INSTALL) $(PY) -q -e '.[compat]'
	test -x $(COMPAT_INSTRUCTOR)/bin/python || $(VENV)/bin/uv venv -q --python $(PYTHON) $(COMPAT_INSTRUCTOR)
	$(UV_INSTALL) $(COMPAT_INSTRUCTOR)/bin/python -q -r tests/compat/instructor.txt
	touch $(COMPAT_STAMP)

serve: $(STAMP)
	$(PY) -m gateway serve $(ARGS)

# N engine replicas on a local Ray Serve behind the prefix-affinity router, one gateway in front
serve-cluster: $(CLUSTER_STAMP)
	$(PY) -m cluster serve --replicas $(REPLICAS) $(ARGS)

model: $(STAMP)
	$(PY) -m engine.model.default_model

# the whole suite, and what .ci/run calls
test: $(STAMP) $(CLUSTER_STAMP) $(COMPAT_STAMP)
	bash scripts/ensure_test_deps.sh
	# the CPU kernels compiled once up front (seconds when numba's cache has them): on a cold cache the first
	# server a test starts would spend its start-up timeout compiling, and a pytest worker compiling holds its
	# files back. Every signature of the decode step the suite runs but Qwen3's in bfloat16 (whose test is that
	# kernel's): what serve runs (Q4_1 weights, bf16 K/V), Q4_1 over fp32 K/V (the quantized models' tests), the
	# tiny models' fp32 over fp32 or bf16 K/V, and bf16 weights, and Q4_1 on integer dot products over fp32 K/V
	# (the int8 tests': quads are a type of their own, compiled apart). Two processes at once: numba compiles on
	# one core
	$(PY) -m engine.model.compile --kv-cache-dtype auto float32 && \
	  $(PY) -m engine.model.compile --kv-cache-dtype float32 --quantized-activations int8 & quantized=$$!; \
	  $(PY) -m engine.model.compile --dtype float32 --kv-cache-dtype auto bfloat16 && \
	  $(PY) -m engine.model.compile --dtype bfloat16; status=$$?; wait $$quantized && exit $$status
	$(PY) -m pytest $(XDIST) $(COVERAGE) $(ARGS)

# the unit tier, for the edit-test loop: no Ray, client frameworks, browser or Prometheus to install.
# schemathesis's pytest plugin is off: no test uses it (the fuzz tests take its strategies), and loading it
# imports all of schemathesis
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -p no:schemathesis -m "not ($(HEAVY))" $(ARGS)

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

bench-quick: $(STAMP)
	$(PY) -m bench --quick $(ARGS)

bench-peers: $(STAMP)
	$(UV_INSTALL) $(PY) -q -e '.[peers]'
	$(PY) -m bench --quick --workloads chatbot --peers $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
