# The two commands a new user needs: `make demo` (the main job) and `make test`.
PY ?= python3

.PHONY: install demo demo-real test
# as root (a container, a GPU box) pip would warn on every run that root installs into the system's Python
install:
	PIP_ROOT_USER_ACTION=ignore $(PY) -m pip install -q -e '.[dev]'

# the demo prints its phases' wall-clock times at the end, the install's included
demo:
	@t0=$$(date +%s.%N); $(MAKE) --no-print-directory install PY=$(PY) && SCD_DEMO_T0=$$t0 $(PY) -m cli.main demo

# the real family (SmolLM2-135M-Instruct + LoRA specialists): builds the producer and calibrates on first run
demo-real: install
	$(PY) -m cli.main demo --config configs/smollm2.yaml

test: install
	$(PY) -m cli.main fetch-family smollm2
	$(PY) -m pytest -q
