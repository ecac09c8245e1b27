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

# the unit tests run alongside the end-to-end ones, at a lower priority: they take the cycles the
# end-to-end tests leave while they wait on servers, and finish long before them; their output
# follows the end-to-end report
test: setup-test
	@unit_log=$$(mktemp /tmp/sglang-rl-unit-tests.XXXXXX); started=$$(date +%s); \
	nice -n 5 $(PY) -m pytest test/unit -v --durations=15 > $$unit_log 2>&1 & unit_pid=$$!; \
	$(PY) -m pytest test/e2e -v --durations=30; e2e_rc=$$?; e2e_s=$$(( $$(date +%s) - started )); \
	wait $$unit_pid; unit_rc=$$?; \
	echo "=================== test/unit (ran alongside test/e2e) ==================="; \
	cat $$unit_log; rm -f $$unit_log; \
	echo "make test: test/e2e exit $$e2e_rc, test/unit exit $$unit_rc; set-up $$(cat .venv/setup-seconds 2>/dev/null || echo ?) s (when it ran), tests $$(( $$(date +%s) - started )) s (e2e $$e2e_s s)"; \
	[ $$e2e_rc -eq 0 ] && [ $$unit_rc -eq 0 ]

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
