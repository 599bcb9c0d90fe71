# SPDX-License-Identifier: Apache-2.0
# The two set-up commands: `make run` (the main job) and `make test` (every test).
# Both install what they need on a Debian machine first (scripts/deps.sh).
JOBS ?= $(shell nproc)
BUILD ?= build
TRACES := $(wildcard tests/data/*.csv.gz)
CMAKE_FLAGS ?=
# Development and test builds treat warnings as errors; a plain cmake build (users, packagers) does not.
DEV_FLAGS := -DCUMA_WERROR=ON

.PHONY: all build run snapshot-table test test-unit test-asan test-tsan test-python test-builds test-pip test-deploy bench format install clean

all: build

build:
	@scripts/deps.sh build
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(DEV_FLAGS) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j$(JOBS)

# The main job: replay the bundled PyTorch traces on the simulated device (sizes x16, GPU
# scale) with the default policy and with the seed's buddy, and print the report.
run: build
	@scripts/run.sh $(BUILD)

# The README's table of PyTorch snapshots (docs/PYTORCH_MODEL.md): each snapshot in SNAPSHOTS
# replayed on the model of PyTorch's allocator and on cuma, against what PyTorch recorded.
# `make snapshot-table SNAPSHOTS=DIR` for another folder; `--model` gives the model's table.
SNAPSHOTS ?= ../shared/snapshots
snapshot-table:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(DEV_FLAGS) $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS) --target cuma_cli >/dev/null
	@scripts/pytorch_model_table.py --readme --cuma $(BUILD)/bin/cuma $(SNAPSHOTS)

# Every phase runs even when an earlier one failed; one summary at the end, and the exit status
# is non-zero if any phase failed (scripts/test-all.sh). A phase is a test-NAME target below and
# NAME in TEST_PHASES.
TEST_PHASES ?= unit asan tsan python builds pip deploy

test:
	@scripts/deps.sh test
	@MAKE="$(MAKE)" scripts/test-all.sh $(TEST_PHASES)

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

test-asan:
	cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCUMA_SANITIZE=address $(DEV_FLAGS) >/dev/null
	cmake --build build-asan -j$(JOBS)
	# Left to the normal build: the replay goals, and the driver variants that repeat a test's
	# code paths with other timing or geometry (lagged replay comparison, the faults script on
	# 4 MiB pages and with costly driver calls); the plain, lagged and per-thread-stream faults
	# scripts and every other variant run here.
	cd build-asan && UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 CUMA_STRESS_OPS=400000 ctest --output-on-failure -j$(JOBS) -E '^(replay_(goals|buddy)_.*|replay_cuda_backends_lagged|test_cuda_faults_(geometry|costly).*)$$'

test-tsan:
	cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUMA_SANITIZE=thread $(DEV_FLAGS) >/dev/null
	cmake --build build-tsan -j$(JOBS) --target test_stress test_tcache test_default_heap test_arena test_fork test_trace_writer test_ledger test_ledger_stress test_heap
	# test_fork_cases is left out: its children start threads (a default heap's release thread),
	# which ThreadSanitizer does not support after a multi-threaded fork.
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1 CUMA_STRESS_OPS=300000 ctest --output-on-failure -R '^(test_(stress|tcache|default_heap|arena|fork|ledger_inprocess|ledger_stress|heap)|trace_writer)' -E test_fork_cases

# Release with gcc and RelWithDebInfo with clang, warnings as errors (scripts/ci-builds.sh).
test-builds: ci-builds

# pip install into a fresh venv from a clean clone, tests against the installed copy.
test-pip: pip-check

# The Kubernetes kit rendered and validated, the autoscaling signal through a real Prometheus,
# and the Dockerfile linted with its build stage run on the host.
test-deploy: deploy-check autoscale-check docker-check

test-python: build
	@if [ -d python/tests ]; then scripts/pytest.sh $(BUILD); else echo "no python tests yet"; fi

# The speed benchmark (bench/README.md): one table; options in BENCH_ARGS (--json, --quick).
BENCH_ARGS ?=
bench: build
	@scripts/deps.sh bench
	@scripts/bench.sh $(BUILD) $(BENCH_ARGS)

# The randomized tests again and again with new seeds, under ASan + UBSan, for SOAK_MINUTES (10).
.PHONY: soak
soak:
	@scripts/deps.sh build
	@scripts/soak.sh

# Instructions per operation under callgrind (bench/profile.sh), repeatable on a busy machine.
.PHONY: profile
profile: build
	@scripts/deps.sh bench
	@bench/profile.sh $(BUILD)

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cpp')

install: build
	cmake --install $(BUILD)

clean:
	rm -rf build build-asan build-tsan

# Fuzzing (tests/fuzz/README.md): the harnesses as libFuzzer targets, built by clang with ASan and
# UBSan, each run for FUZZ_SECONDS on its seed corpus; new inputs go to $(FUZZ_BUILD)/corpus,
# crashes to $(FUZZ_BUILD)/crashes. `make test` replays the seeds only (fuzz_regress_*).
FUZZ_SECONDS ?= 60
# FUZZ_RUNS=N: each target runs N inputs instead (no time limit), e.g. FUZZ_RUNS=1000000.
FUZZ_RUNS ?=
FUZZ_BUILD ?= build-fuzz
FUZZ_TARGETS ?= fuzz_config fuzz_trace fuzz_snapshot fuzz_chrome fuzz_ledger_file fuzz_heap
.PHONY: fuzz
fuzz:
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
		-DCUMA_SANITIZE=address -DCUMA_FUZZ=ON $(DEV_FLAGS) >/dev/null
	cmake --build $(FUZZ_BUILD) -j$(JOBS) --target $(FUZZ_TARGETS)
	@failed=; for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_BUILD)/corpus/$$t $(FUZZ_BUILD)/crashes/$$t; \
		echo "== $$t: $(if $(FUZZ_RUNS),$(FUZZ_RUNS) runs,$(FUZZ_SECONDS) s)"; s=$$(date +%s); \
		UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(FUZZ_BUILD)/tests/fuzz/$$t \
			$(if $(FUZZ_RUNS),-runs=$(FUZZ_RUNS),-max_total_time=$(FUZZ_SECONDS)) -print_final_stats=1 \
			-artifact_prefix=$(FUZZ_BUILD)/crashes/$$t/ \
			$(FUZZ_BUILD)/corpus/$$t tests/fuzz/corpus/$$t || failed="$$failed $$t"; \
		echo "== $$t: done in $$(( $$(date +%s) - s )) s"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: findings in$$failed (see $(FUZZ_BUILD)/crashes)"; exit 1; fi

# The packagers' and other compilers' builds, warnings as errors: gcc Release, clang RelWithDebInfo.
.PHONY: ci-builds
ci-builds:
	@scripts/deps.sh test
	@scripts/ci-builds.sh

# The Python package as pip installs it: a clean clone into a fresh venv, tests on the copy.
.PHONY: pip-check
pip-check:
	@scripts/deps.sh test
	@scripts/pip-check.sh

# The Dockerfile: built where a container builder works, else linted and its build stage run here.
.PHONY: docker-check
docker-check:
	@scripts/deps.sh build
	@scripts/docker-check.sh

# The Kubernetes kit (deploy/): rendered and validated offline.
.PHONY: deploy-check
deploy-check:
	@scripts/deps.sh deploy
	@scripts/deploy-check.sh

# The autoscaling signal end to end: jobs, exporters and a real Prometheus on loopback.
.PHONY: autoscale-check
autoscale-check: build
	@scripts/deps.sh deploy
	@/usr/bin/python3 tests/deploy/test_autoscale_signal.py $(BUILD)
