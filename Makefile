# attnsweep: every set-up step lives here and is safe to re-run.
#   make demo   set up, build, then run the demo sweep (sweeps/demo.toml) and draw its figures
#   make test   set up, build, then run the whole test suite

PYTHON        ?= python3
VENV          := .venv
TORCH_VERSION := 2.11.0
STAMP         := $(VENV)/.torch-$(TORCH_VERSION)
# The conversion tests build tiny models with transformers, and tiny GGUF files with
# llama.cpp's gguf package, to compare logits against (transformers reads GGUF through
# accelerate).
TRANSFORMERS  := 4.57.6
GGUF          := 0.19.0
ACCELERATE    := 1.15.0
TEST_STAMP    := $(VENV)/.transformers-$(TRANSFORMERS)-gguf-$(GGUF)-accelerate-$(ACCELERATE)
BIN           := target/release/attnsweep

# torch-sys finds libtorch through the project's Python environment; build.rs then bakes its
# location into the binary (rpath), so nothing needs exporting at run time.
export PATH                := $(CURDIR)/$(VENV)/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
unexport LIBTORCH

.PHONY: setup build test demo clean

setup: $(STAMP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --disable-pip-version-check --quiet torch==$(TORCH_VERSION)
	touch $@

$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install --disable-pip-version-check --quiet transformers==$(TRANSFORMERS) \
		gguf==$(GGUF) accelerate==$(ACCELERATE)
	touch $@

build: setup
	cargo build --release --locked

test: build $(TEST_STAMP)
	cargo test --release --locked
	@# tests/slurm.rs starts a one-node Slurm of its own: it runs where the daemons are installed.
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then \
		cargo test --release --locked --test slurm -- --ignored; \
	else \
		echo "tests/slurm.rs skipped: slurmctld, slurmd and munged are not installed (Debian: apt-get install slurm-wlm munge)"; \
	fi

# The demo grid (sweeps/demo.toml): a full-attention base on the synthetic corpus, continued
# as AHA over windows and penalties and as PPA over powers; tables and figures land in
# runs/demo, which git ignores: they hold measured rates (tokens/s) that differ from run to
# run, so the demo leaves a clone's tree as it found it. results/demo holds a committed run
# (its README gives the command). A second `make demo` finds the cells finished and redraws.
DEMO_OUT := runs/demo
demo: build
	$(BIN) sweep --grid sweeps/demo.toml --out $(DEMO_OUT)
	$(BIN) plot --sweep $(DEMO_OUT)

clean:
	rm -rf target $(VENV) runs
