# attnsweep: every set-up step lives here and is safe to re-run.
#   make demo   set up, build, then train and evaluate small models on the synthetic corpus
#   make test   set up, build, then run the whole test suite

PYTHON        ?= python3
VENV          := .venv
TORCH_VERSION := 2.11.0
STAMP         := $(VENV)/.torch-$(TORCH_VERSION)
BIN           := target/release/attnsweep
DEMO          := runs/demo

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

build: setup
	cargo build --release --locked

test: build
	cargo test --release --locked

# A full-attention model and a sliding-window model (w=16) on the same synthetic corpus; the
# per-bucket tables show where the window costs quality: dependencies 16 or more tokens back.
DEMO_SET := --set data.dir=$(DEMO)/data --set data.seq_len=128 --set attention.window=16 \
            --set train.steps=800 --set train.warmup_steps=50

demo: build
	@test -f $(DEMO)/data/meta.json || \
	  $(BIN) data synth --out $(DEMO)/data --train-tokens 1000000 --val-tokens 65536 --max-distance 128
	@for m in full swa; do \
	  if [ -f $(DEMO)/$$m/eval/eval.json ]; then echo "$$m: already trained"; continue; fi; \
	  resume=; [ -f $(DEMO)/$$m/config.toml ] && resume=--resume; \
	  $(BIN) train $(DEMO_SET) --set attention.method=$$m --out $(DEMO)/$$m $$resume || exit 1; \
	done
	@for m in full swa; do echo "== $$m"; $(BIN) eval --run $(DEMO)/$$m || exit 1; done

clean:
	rm -rf target $(VENV) runs
