# The two commands a new user needs: `make demo` (the main job) and `make test`.
PY ?= python3

.PHONY: install demo test
install:
	$(PY) -m pip install -q -e '.[dev]'

demo: install
	$(PY) -m cli.main demo

test: install
	$(PY) -m pytest -q
