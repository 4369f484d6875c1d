# The README's commands (make train, make test; make docs and make readme), plus the environment they share.
# Each target creates .venv and installs rtrainer into it on first use; nothing is installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rtrainer-installed

.PHONY: install data train test docs readme

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch, pinned: an unpinned torch can pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

data: $(STAMP)
	$(BIN)/rtrainer prepare --source python-docs --out data/python-docs

train: $(STAMP)
	$(BIN)/rtrainer train

test: $(STAMP)
	bash tests/run_all.sh

docs: $(STAMP)
	$(BIN)/python tools/build_docs.py --out _docs

readme: $(STAMP)
	$(BIN)/python tools/build_docs.py --readme
