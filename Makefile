# Two entry points for a newcomer: `make demo` and `make test` (each does its own set-up).
PY := .venv/bin/python
STAMP := .venv/.setup-stamp

.PHONY: setup demo demo-cotrain test test-unit test-gpu fuzz soak soak-cotrain model

setup: $(STAMP)

$(STAMP): scripts/setup_cpu.sh requirements/cpu.txt requirements/verl-gpu.txt requirements/verl-overrides.txt python/pyproject.toml client/pyproject.toml scripts/cpu_shims/* scripts/cpu_shims/sgl_kernel/*
	bash scripts/setup_cpu.sh

model: setup
	$(PY) -m sglang_rl.cli model

demo: setup
	$(PY) toploc-scripts/minimal_example.py --start-server

demo-cotrain: setup
	$(PY) scripts/demo_cotrain.py

test: setup
	$(PY) -m pytest test/unit test/e2e -v --durations=30

# on a machine with CUDA and the plugin installed (not part of `make test`)
test-gpu:
	python -m pytest test/gpu -v -s

fuzz: setup
	$(PY) scripts/fuzz_http.py --cases 10000

# not part of `make test`: about 15 minutes (a burst of 256 requests, then a 10-minute soak)
soak: setup
	$(PY) scripts/soak.py --burst 256 --soak-seconds 600

# not part of `make test`: one hour of co-training under load; memory of the buffer, trainer and server
soak-cotrain: setup
	$(PY) scripts/soak_cotrain.py --minutes 60 --out soak_cotrain.jsonl

test-unit: setup
	$(PY) -m pytest test/unit -v
