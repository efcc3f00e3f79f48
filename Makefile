# The two commands of the README: `make run` (a real tiny DGPO job on CPU) and `make test`.
# Both create the CPU environment in .venv first if it is absent or out of date.
PYTHON_ENV := .venv
STAMP := $(PYTHON_ENV)/.installed
PY := $(PYTHON_ENV)/bin/python
OUT ?= outputs

.PHONY: env run test clean-env

env: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt tools/setup_env.sh
	bash tools/setup_env.sh $(PYTHON_ENV)
	touch $(STAMP)

run: $(STAMP)
	mkdir -p $(OUT)
	$(PY) -m megatron_dgpo.losses --n 1 --m 2 --plot $(OUT)/loss_coefficients.png

test: $(STAMP)
	$(PY) -m pytest -q tests

clean-env:
	rm -rf $(PYTHON_ENV)
