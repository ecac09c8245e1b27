# Two entry points for a newcomer: `make demo` and `make test` (each does its own set-up).
PY := .venv/bin/python
STAMP := .venv/.setup-stamp
TEST_STAMP := .venv/.test-stamp
SETUP_INPUTS := scripts/setup_cpu.sh requirements/cpu.txt python/pyproject.toml client/pyproject.toml scripts/cpu_shims/* scripts/cpu_shims/sgl_kernel/*

.PHONY: setup setup-test demo demo-cotrain test test-unit test-gpu fuzz soak soak-cotrain model

# what `make demo` needs: sglang on the CPU, toploc, the plugin, the default model's package
setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	bash scripts/setup_cpu.sh

# what the tests add: pytest, the data set, verl and its runtime
setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(SETUP_INPUTS) requirements/test.txt requirements/verl-gpu.txt requirements/verl-overrides.txt
	bash scripts/setup_cpu.sh tests

model: setup
	$(PY) -m sglang_rl.cli model

demo: setup
	$(PY) toploc-scripts/minimal_example.py --start-server

demo-cotrain: setup-test
	$(PY) scripts/demo_cotrain.py

# three pytest runs side by side on 2 cores: the end-to-end modules' main part in the foreground;
# beside it the unit tests at a lower priority (they take the cycles left while servers are
# awaited), then the end-to-end modules of the TOPLOC part (test/e2e/conftest.py: --e2e-part).
# The reports of the two background runs follow the main one.
test: setup-test
	@logs=$$(mktemp -d /tmp/sglang-rl-tests.XXXXXX); started=$$(date +%s); \
	( nice -n 5 $(PY) -m pytest test/unit -v --durations=15 > $$logs/unit 2>&1; echo $$? > $$logs/unit.rc; \
	  $(PY) -m pytest test/e2e --e2e-part toploc -v --durations=15 > $$logs/toploc 2>&1; echo $$? > $$logs/toploc.rc; \
	  echo $$(( $$(date +%s) - started )) > $$logs/toploc.s ) & background=$$!; \
	$(PY) -m pytest test/e2e --e2e-part main -v --durations=30; main_rc=$$?; main_s=$$(( $$(date +%s) - started )); \
	wait $$background; \
	echo "=================== test/e2e --e2e-part toploc (ran alongside, after test/unit) ==================="; \
	cat $$logs/toploc; \
	echo "=================== test/unit (ran alongside test/e2e) ==================="; \
	cat $$logs/unit; \
	toploc_rc=$$(cat $$logs/toploc.rc 2>/dev/null || echo 1); unit_rc=$$(cat $$logs/unit.rc 2>/dev/null || echo 1); \
	echo "make test: test/e2e main part exit $$main_rc ($$main_s s), toploc part exit $$toploc_rc (done at $$(cat $$logs/toploc.s 2>/dev/null || echo ?) s), test/unit exit $$unit_rc; set-up $$(cat .venv/setup-seconds 2>/dev/null || echo ?) s (when it ran), tests $$(( $$(date +%s) - started )) s"; \
	rm -rf $$logs; \
	[ $$main_rc -eq 0 ] && [ $$toploc_rc -eq 0 ] && [ $$unit_rc -eq 0 ]

# on a machine with CUDA and the plugin installed (not part of `make test`)
test-gpu:
	python -m pytest test/gpu -v -s

fuzz: setup-test
	$(PY) scripts/fuzz_http.py --cases 10000

# not part of `make test`: about 15 minutes (a burst of 256 requests, then a 10-minute soak)
soak: setup-test
	$(PY) scripts/soak.py --burst 256 --soak-seconds 600

# not part of `make test`: one hour of co-training under load; memory of the buffer, trainer and server
soak-cotrain: setup-test
	$(PY) scripts/soak_cotrain.py --minutes 60 --out soak_cotrain.jsonl

test-unit: setup-test
	$(PY) -m pytest test/unit -v
