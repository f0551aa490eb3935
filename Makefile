# Set-up and the two entry points of the README: `make demo` (main job) and `make test`.
# Everything installs into a fresh virtual environment in .venv; nothing outside it is used.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# A CPU build of PyTorch: an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv demo test lint docs mutants clean

$(BIN)/rpb: pyproject.toml tests/integrations/axolotl/pins.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,docs]"
	echo "$(TORCH)" > $(VENV)/torch-pin.txt
	@# four installs side by side (about 30 s less than one after another): the extras into the venv, and into
	@# folders of their own (--no-deps, so none reads or writes the venv's packages) each tested Megatron-Bridge
	@# line's wheels, for the contract tests, which put one folder at a time on PYTHONPATH (docs/megatron.md), and
	@# axolotl with the Hugging Face stack it pins exactly, for the plugin's contract test, which puts it first on
	@# PYTHONPATH in a subprocess (tests/integrations/axolotl/pins.txt, docs/training.md); any one failing fails. The
	@# extras start last: they reinstall rpb, which the lines' commands run
	pids=""; \
	for line in $$($(BIN)/python -m rpb.integrations.megatron.versions lines); do \
	  args=$$($(BIN)/python -m rpb.integrations.megatron.versions pip-args $$line) || exit 1; \
	  { rm -rf $(VENV)/bridge/$$line && $(BIN)/python -m pip install --quiet --target $(VENV)/bridge/$$line $$args; } & \
	  pids="$$pids $$!"; done; \
	{ rm -rf $(VENV)/axolotl && $(BIN)/python -m pip install --quiet --no-deps --target $(VENV)/axolotl \
	  -r tests/integrations/axolotl/pins.txt; } & pids="$$pids $$!"; \
	$(BIN)/python -m pip install --quiet -c $(VENV)/torch-pin.txt -e ".[megatron,trl,peft]" & pids="$$pids $$!"; \
	failed=0; for pid in $$pids; do wait $$pid || failed=1; done; exit $$failed
	@touch $@

venv: $(BIN)/rpb

demo: venv
	$(BIN)/rpb demo --out rpb-demo

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	@# the same lines twice in src/ (6 or more, comments and docstrings aside): pylint's similarity checker
	$(BIN)/symilar -d 6 --ignore-comments --ignore-docstrings $$(find src/rpb -name '*.py' | sort) | tee $(VENV)/symilar.txt
	@grep -q '^TOTAL .* duplicates=0 ' $(VENV)/symilar.txt || { echo "lint: duplicated blocks in src/ (above)"; exit 1; }

# the documentation site, built strictly (a broken link, a page outside the nav, a missing API name fail); the
# pages go to $(VENV)/site, never into the tree
docs: venv
	@# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build, not a finding
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(abspath $(VENV))/site

# two xdist workers (the cores here), one torch thread each (tests/conftest.py); a module's tests share a worker
test: venv lint docs
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# every mutant of tests/mutants/catalogue.py against the tests that must catch it (docs/testing.md)
mutants: venv
	$(BIN)/python -m tests.mutants

clean:
	rm -rf $(VENV) rpb-demo .pytest_cache .ruff_cache
