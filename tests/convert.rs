//! Conversion parity: tiny random models of each family built with Hugging Face
//! `transformers` (tests/hf_fixtures.py, no download), and tiny GGUF files of each tensor type
//! written with llama.cpp's `gguf` package (tests/gguf_fixtures.py), converted, and run here:
//! next-token logits must match what transformers makes of the same files within 1e-4
//! relative error in fp32 on the CPU.

mod common;
use common::bin;

use attnsweep::config::Config;
use attnsweep::model::attention::ForwardCtx;
use attnsweep::run::Built;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

/// The Hugging Face fixtures, generated once per test process.
fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| generate("hf_fixtures.py", "hf"))
}

/// The GGUF fixtures, generated once per test process.
fn gguf_fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| generate("gguf_fixtures.py", "gguf"))
}

/// Runs a fixture script of tests/ into a fresh directory.
fn generate(script: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("attnsweep-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let py = std::env::var("ATTNSWEEP_PYTHON").unwrap_or_else(|_| "python3".into());
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(script);
    let o = Command::new(&py)
        .arg(&path)
        .arg(&dir)
        .output()
        .expect("python3 runs");
    assert!(
        o.status.success(),
        "tests/{script} failed (make test installs transformers, gguf and accelerate into the project environment):\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

fn convert(args: &[&str]) -> std::process::Output {
    bin()
        .arg("convert")
        .args(args)
        .output()
        .expect("binary runs")
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("attnsweep-conv-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Logits of a converted model on the fixture's ids, and the fixture's expected logits.
fn logits(converted: &Path, expected: &Path) -> (Tensor, Tensor) {
    let cfg = Config::load(
        Some(&converted.join("config.toml")),
        &["train.device=cpu".into()],
    )
    .unwrap();
    let built = Built::new(&cfg, Device::Cpu).unwrap();
    attnsweep::io::checkpoint::load_into(
        &built.params(),
        &converted.join("model.safetensors"),
        true,
        attnsweep::io::checkpoint::Precision::AnyFloat,
    )
    .unwrap();
    let want: std::collections::BTreeMap<String, Tensor> = Tensor::read_safetensors(expected)
        .unwrap()
        .into_iter()
        .collect();
    let got = tch::no_grad(|| {
        built
            .model
            .forward(&want["ids"], &ForwardCtx::default())
            .logits
    });
    (got, want["logits"].to_kind(Kind::Float))
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).norm().double_value(&[]) / b.norm().double_value(&[])
}

#[test]
fn every_family_matches_transformers_logits() {
    let fx = fixtures();
    let mut outs = Vec::new();
    for family in ["llama", "qwen2", "qwen3", "olmo2"] {
        let out = scratch(family);
        outs.push(out.clone());
        let o = convert(&[
            "--from",
            fx.join(family).to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(
            o.status.success(),
            "{family}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let (got, want) = logits(&out, &fx.join(family).join("expected.safetensors"));
        let e = rel_err(&got, &want);
        assert!(
            e < 1e-4,
            "{family}: logits differ from transformers by {e:.2e} (relative)"
        );
    }
    let toml = std::fs::read_to_string(outs[0].join("config.toml")).unwrap();
    assert!(toml.contains("rope_type = \"llama3\""), "{toml}");
}

/// PyTorch's own formats convert without Python: torch.save state dicts (plain and wrapped),
/// transformers' pytorch_model.bin, a TorchScript archive and a tch VarStore file; a pickle
/// naming an object only Python can build is refused by name unless --allow-pickle.
#[test]
fn pytorch_checkpoints_convert_in_process() {
    let fx = fixtures();
    let cfgj = fx.join("llama/config.json");
    let want = fx.join("llama/expected.safetensors");
    let check = |from: &Path, extra: &[&str], tag: &str| {
        let out = scratch(tag);
        let mut args = vec![
            "--from",
            from.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        if from.is_file() {
            args.extend(["--config", cfgj.to_str().unwrap()]);
        }
        args.extend(extra);
        let o = convert(&args);
        assert!(
            o.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let (got, want) = logits(&out, &want);
        assert!(rel_err(&got, &want) < 1e-4, "{tag}");
        out
    };
    for (file, tag) in [
        ("llama_state_dict.pt", "state-dict"),
        ("llama_wrapped.pt", "wrapped"),
        ("llama_script.pt", "torchscript"),
    ] {
        check(&fx.join(file), &[], tag);
    }
    let converted = check(&fx.join("llama_bin"), &[], "pytorch-model-bin");

    // A tch VarStore file (.ot) of the converted model, read back.
    let cfg = Config::load(
        Some(&converted.join("config.toml")),
        &["train.device=cpu".into()],
    )
    .unwrap();
    let built = Built::new(&cfg, Device::Cpu).unwrap();
    attnsweep::io::checkpoint::load_into(
        &built.params(),
        &converted.join("model.safetensors"),
        true,
        attnsweep::io::checkpoint::Precision::AnyFloat,
    )
    .unwrap();
    let ot = scratch("varstore").with_extension("ot");
    built.vs.save(&ot).unwrap();
    check(&ot, &[], "varstore");

    // An argparse.Namespace inside: refused, named, nothing written; Python reads it when
    // the user trusts the file.
    let ns = fx.join("llama_namespace.pt");
    let out = scratch("namespace");
    let o = convert(&[
        "--from",
        ns.to_str().unwrap(),
        "--config",
        cfgj.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("argparse.Namespace") && err.contains("--allow-pickle"),
        "{err}"
    );
    assert!(!out.join("model.safetensors").exists(), "nothing written");
    check(&ns, &["--allow-pickle"], "namespace-allowed");
}

#[test]
fn export_then_import_is_exact_and_continued_training_works() {
    let fx = fixtures();
    let conv = scratch("exp-src");
    assert!(convert(&[
        "--from",
        fx.join("qwen3").to_str().unwrap(),
        "--out",
        conv.to_str().unwrap(),
        "--dtype",
        "fp32"
    ])
    .status
    .success());
    // A run directory from the converted model: continued pretraining as AHA, then export
    // of the base (full attention) weights and re-import.
    let data = scratch("exp-data");
    let o = bin()
        .args([
            "data",
            "synth",
            "--out",
            data.to_str().unwrap(),
            "--vocab-size",
            "97",
            "--n-keys",
            "8",
            "--n-values",
            "8",
            "--train-tokens",
            "5000",
            "--val-tokens",
            "2000",
            "--max-distance",
            "32",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run = scratch("exp-run");
    let data_set = format!("data.dir={}", data.display());
    for method in ["aha", "l2a", "swiattn", "swa", "ppa", "full"] {
        let out = run.join(method);
        let o = bin()
            .args([
                "train",
                "-q",
                "--config",
                conv.join("config.toml").to_str().unwrap(),
                "--init-from",
                conv.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ])
            .args([
                "--set",
                &data_set,
                "--set",
                "data.seq_len=32",
                "--set",
                "train.steps=2",
                "--set",
                "train.warmup_steps=0",
                "--set",
                "train.batch_size=2",
                "--set",
                "eval.max_batches=1",
                "--set",
                &format!("attention.method={method}"),
                "--set",
                "attention.window=8",
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "continued pretraining of {method} from a converted model: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // Export the converted model itself (as a run: its config plus weights) and convert back.
    // Its config names no data set (data.dir = ""), and export reads none.
    let as_run = scratch("exp-asrun");
    std::fs::create_dir_all(&as_run).unwrap();
    let cfg = std::fs::read_to_string(conv.join("config.toml")).unwrap();
    assert!(cfg.contains("[data]\ndir = \"\""), "{cfg}");
    std::fs::write(as_run.join("config.toml"), cfg).unwrap();
    std::fs::copy(
        conv.join("model.safetensors"),
        as_run.join("model.safetensors"),
    )
    .unwrap();
    let hf = scratch("exp-hf");
    let o = bin()
        .args([
            "export",
            "--run",
            as_run.to_str().unwrap(),
            "--out",
            hf.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Nothing is exported over a model or into a run, whose checkpoints it would shadow.
    for taken in [&hf, &as_run] {
        let o = bin()
            .args(["export", "--run", as_run.to_str().unwrap(), "--out"])
            .arg(taken)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && e.contains("already holds a model or a run"),
            "{e}"
        );
    }
    let back = scratch("exp-back");
    assert!(convert(&[
        "--from",
        hf.to_str().unwrap(),
        "--out",
        back.to_str().unwrap()
    ])
    .status
    .success());
    let a: std::collections::BTreeMap<String, Tensor> =
        Tensor::read_safetensors(conv.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let b: std::collections::BTreeMap<String, Tensor> =
        Tensor::read_safetensors(back.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (n, t) in &a {
        assert!(t.equal(&b[n]), "{n} changed through export and import");
    }
    let hfc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(hfc["architectures"][0], "Qwen3ForCausalLM");
    // A routed run exports only in Llama's shape (here Qwen3's, with q/k norms: refused).
    let o = bin()
        .args([
            "export",
            "--run",
            run.join("aha").to_str().unwrap(),
            "--out",
            scratch("exp-bad").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("of Llama's shape") && e.contains("Qwen3"), "{e}");
}

#[test]
fn bad_sources_fail_clearly_and_write_nothing() {
    let fx = fixtures();
    let work = scratch("bad");
    let copy = |name: &str| {
        let d = work.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fx.join("qwen2").join(f), d.join(f)).unwrap();
        }
        d
    };
    let run = |src: &Path| {
        let out = work.join(format!(
            "{}-out",
            src.file_name().unwrap().to_string_lossy()
        ));
        let o = convert(&[
            "--from",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(!o.status.success());
        assert!(
            !out.join("model.safetensors").exists() && !out.join("config.toml").exists(),
            "partial output in {}",
            out.display()
        );
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    // Truncated weights.
    let d = copy("truncated");
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    assert!(run(&d).contains("truncated or corrupt"));
    // Unsupported architecture.
    let d = copy("arch");
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("Qwen2ForCausalLM", "GPT2LMHeadModel");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    assert!(run(&d).contains("\"GPT2LMHeadModel\" is not supported"));
    // Shape mismatch: the config claims a wider MLP.
    let d = copy("shape");
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 48", "\"intermediate_size\": 64");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = run(&d);
    assert!(
        e.contains("mlp.up_proj.weight has shape [48, 32], the config implies [64, 32]"),
        "{e}"
    );
    // Missing tensor: one layer fewer in the file than the config says.
    let d = copy("missing");
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = run(&d);
    assert!(
        e.contains("missing tensors") && e.contains("model.layers.2.self_attn.q_proj.weight"),
        "{e}"
    );
    // A tensor the model has no place for: one layer more in the file.
    let d = copy("extra");
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = run(&d);
    assert!(
        e.contains("no place for") && e.contains("model.layers.1."),
        "{e}"
    );
    // A disk that fills after the weights (the second write fails): nothing is left, and the
    // same command then converts.
    let d = copy("full-disk");
    let out = work.join("full-disk-out");
    let args = [
        "convert",
        "--from",
        d.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let o = bin()
        .args(args)
        .env("ATTNSWEEP_FAIL_WRITE", "2")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("No space left"), "{e}");
    let left: Vec<_> = std::fs::read_dir(&out).unwrap().collect();
    assert!(left.is_empty(), "partial output: {left:?}");
    let o = bin().args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The GGUF fixture `name` converted into a fresh directory (`tag` keeps tests apart).
fn convert_gguf(name: &str, tag: &str) -> PathBuf {
    let out = scratch(&format!("gguf-{tag}-{name}"));
    let src = gguf_fixtures().join(format!("{name}.gguf"));
    let o = convert(&[
        "--from",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// An exported model carries its tokenizer, a generation config and its context: transformers'
/// AutoTokenizer reads the folder as it is and gives the ids ours gives, and the context is the
/// longer of what the tokenizer declares and what the run trained at.
#[test]
fn an_export_carries_its_tokenizer_and_context() {
    let run = convert_gguf("f32", "export");
    let cfg = run.join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("seq_len = 256", "seq_len = 32")).unwrap();
    let hf = scratch("export-tok");
    let o = bin()
        .args(["export", "--run", run.to_str().unwrap(), "--out"])
        .arg(&hf)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(hf.join(f).is_file(), "{f} missing from the export");
    }
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    // The fixture's GGUF declares a context of 64, longer than the 32 the run names.
    assert_eq!(c["max_position_embeddings"], 64);
    assert!(c["eos_token_id"].is_u64());
    let text = "hello world 12345";
    let ours = tokenizers::Tokenizer::from_file(run.join("tokenizer.json"))
        .unwrap()
        .encode(text, false)
        .unwrap()
        .get_ids()
        .to_vec();
    let py = std::env::var("ATTNSWEEP_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = format!(
        "import sys, json; from transformers import AutoTokenizer\n\
         t = AutoTokenizer.from_pretrained(sys.argv[1])\n\
         print(json.dumps(t({text:?}, add_special_tokens=False)['input_ids']))"
    );
    let o = Command::new(py)
        .args(["-c", &script])
        .arg(&hf)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let theirs: Vec<u32> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(theirs, ours);
}

/// Every GGUF tensor type read gives transformers' logits (its own GGUF loader, fp32), Llama's
/// Q and K rows restored, tied and untied heads, Qwen2's biases.
#[test]
fn every_gguf_tensor_type_matches_transformers_logits() {
    let fx = gguf_fixtures();
    for name in [
        "f32",
        "f16",
        "bf16",
        "q8_0",
        "q4_0",
        "q4_1",
        "q5_0",
        "q5_1",
        "q4_k",
        "q5_k",
        "q6_k",
        "qwen2_f16",
    ] {
        let out = convert_gguf(name, "logits");
        let (got, want) = logits(&out, &fx.join(format!("{name}.expected.safetensors")));
        let e = rel_err(&got, &want);
        assert!(
            e < 1e-4,
            "{name}: logits differ from transformers by {e:.2e} (relative)"
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// The tokenizer written from a GGUF file's metadata gives transformers' ids without the BOS
/// transformers prepends (the file says add_bos_token = false); SmolLM2's pre-tokenizer
/// ("smollm") splits digits one by one, as llama.cpp does and transformers does not; the
/// chat template and special tokens travel along.
#[test]
fn a_gguf_tokenizer_follows_the_file() {
    let fx = gguf_fixtures();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.join("tokens.json")).unwrap()).unwrap();
    let bos = expected["bos_token_id"].as_u64().unwrap() as u32;
    let tokenizer_of = |name: &str| {
        let out = convert_gguf(name, "tokenizer");
        (
            tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap(),
            out,
        )
    };
    let ids =
        |t: &tokenizers::Tokenizer, text: &str| t.encode(text, true).unwrap().get_ids().to_vec();
    let (gpt2, out) = tokenizer_of("f32");
    for (text, want) in expected["texts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(expected["ids"].as_array().unwrap())
    {
        let want: Vec<u32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(want[0], bos, "transformers prepends BOS");
        assert_eq!(
            ids(&gpt2, text.as_str().unwrap()),
            want[1..].to_vec(),
            "{text}"
        );
    }
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["add_bos_token"], false);
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));

    let (smollm, _) = tokenizer_of("q8_0");
    let no_digits = expected["texts"][0].as_str().unwrap();
    assert_eq!(ids(&smollm, no_digits), ids(&gpt2, no_digits));
    let twelve = gpt2.token_to_id("12").unwrap();
    assert!(ids(&gpt2, "12 cats").contains(&twelve));
    assert!(
        !ids(&smollm, "12 cats").contains(&twelve),
        "digits split one by one"
    );
    assert_eq!(
        smollm
            .decode(&ids(&smollm, "in 2024, 12 cats"), false)
            .unwrap(),
        "in 2024, 12 cats"
    );
}

/// A GGUF file of an architecture not read, or cut short, is refused by name; nothing written.
#[test]
fn a_gguf_file_not_read_is_refused_by_name() {
    let fx = gguf_fixtures();
    let work = scratch("gguf-bad");
    std::fs::create_dir_all(&work).unwrap();
    let bytes = std::fs::read(fx.join("f16.gguf")).unwrap();
    let refuse = |name: &str, bytes: &[u8], needle: &str| {
        let src = work.join(name);
        std::fs::write(&src, bytes).unwrap();
        let out = work.join(format!("{name}-out"));
        let o = convert(&[
            "--from",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle), "{name}: {err}");
        assert!(
            !out.join("model.safetensors").exists(),
            "{name}: nothing written"
        );
    };
    // general.architecture's value, "llama", follows its key, type (u32) and length (u64).
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 12;
    let mut other = bytes.clone();
    other[at..at + 5].copy_from_slice(b"mamba");
    refuse(
        "arch.gguf",
        &other,
        "general.architecture = \"mamba\" is not supported",
    );
    refuse("cut.gguf", &bytes[..bytes.len() - 100], "truncated");
    let mut config = vec![];
    config.extend_from_slice(b"{}");
    std::fs::write(work.join("config.json"), &config).unwrap();
    let src = fx.join("f16.gguf");
    let o = convert(&[
        "--from",
        src.to_str().unwrap(),
        "--config",
        work.join("config.json").to_str().unwrap(),
        "--out",
        work.join("with-config").to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("leave out --config"));

    // A `.gguf` whose magic is damaged or cut short is refused as GGUF, not taken for a
    // weight file without its config.
    let mut magic = bytes.clone();
    magic[..4].copy_from_slice(b"GGUX");
    refuse("magic.gguf", &magic, "does not start with the magic GGUF");
    refuse("short.gguf", b"GG", "does not start with the magic GGUF");

    // Metadata of another type than GGUF's is refused by name, not defaulted: the bool
    // add_bos_token retyped as a u8 (type 7 to 0, the value's one byte kept).
    let key = b"tokenizer.ggml.add_bos_token";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    let mut retyped = bytes.clone();
    retyped[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
    refuse(
        "retyped.gguf",
        &retyped,
        "tokenizer.ggml.add_bos_token is an integer, not a bool",
    );
}

/// The name (GGUF's, before conversion) of each tensor of a GGUF file and where its
/// dimension count lies, read with the file's own layout (version 3, metadata first).
fn gguf_tensor_infos(bytes: &[u8]) -> Vec<(String, usize)> {
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let (n_tensors, n_meta) = (u64_at(8), u64_at(16));
    let mut at = 24;
    // Skips one value of type `ty` from `at`.
    fn skip(bytes: &[u8], at: usize, ty: u32) -> usize {
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => at + 1,
            2 | 3 => at + 2,
            4 | 5 | 6 => at + 4,
            10 | 11 | 12 => at + 8,
            8 => at + 8 + u64_at(at),
            9 => {
                let inner = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
                let n = u64_at(at + 4);
                (0..n).fold(at + 12, |a, _| skip(bytes, a, inner))
            }
            _ => panic!("type {ty}"),
        }
    }
    for _ in 0..n_meta {
        at += 8 + u64_at(at);
        let ty = u32_at(at);
        at = skip(bytes, at + 4, ty);
    }
    let mut infos = vec![];
    for _ in 0..n_tensors {
        let len = u64_at(at);
        let name = String::from_utf8(bytes[at + 8..at + 8 + len].to_vec()).unwrap();
        at += 8 + len;
        infos.push((name, at));
        let dims = u32_at(at) as usize;
        at += 4 + 8 * dims + 4 + 8;
    }
    infos
}

/// A GGUF file is checked against the model before any tensor is read: a tensor of the wrong
/// shape is named although a later tensor holds NaN (which only reading finds), and a tensor
/// name given twice is refused, leaving no scratch files behind.
#[test]
fn a_gguf_file_is_checked_before_its_tensors_are_read() {
    let fx = gguf_fixtures();
    let work = scratch("gguf-checked");
    let tmp = work.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let bytes = std::fs::read(fx.join("f16.gguf")).unwrap();
    let infos = gguf_tensor_infos(&bytes);
    let refuse = |name: &str, bytes: &[u8], needle: &str| {
        let src = work.join(name);
        std::fs::write(&src, bytes).unwrap();
        let out = work.join(format!("{name}-out"));
        let o = bin()
            .env("TMPDIR", &tmp)
            .args([
                "convert",
                "--from",
                src.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle), "{name}: {err}");
        assert!(!err.contains("internal error"), "{name}: {err}");
        let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
        assert!(left.is_empty(), "{name}: scratch left behind: {left:?}");
    };

    // The first 2-D tensor's dimensions swapped (its length unchanged), and the last
    // tensor's first value a NaN.
    let (name, dims_at) = infos
        .iter()
        .find(|(_, at)| bytes[*at] == 2)
        .expect("a 2-D tensor")
        .clone();
    let mut wrong = bytes.clone();
    let (a, b) = (dims_at + 4, dims_at + 12);
    let (d0, d1) = (wrong[a..a + 8].to_vec(), wrong[b..b + 8].to_vec());
    assert_ne!(d0, d1, "{name} is square");
    wrong[a..a + 8].copy_from_slice(&d1);
    wrong[b..b + 8].copy_from_slice(&d0);
    let last = infos.last().unwrap().1;
    let ndims = wrong[last] as usize;
    let ty_at = last + 4 + 8 * ndims;
    let offset = u64::from_le_bytes(wrong[ty_at + 4..ty_at + 12].try_into().unwrap()) as usize;
    let data_start = (ty_at + 12).div_ceil(32) * 32;
    let nan: &[u8] = match u32::from_le_bytes(wrong[ty_at..ty_at + 4].try_into().unwrap()) {
        0 => &[0, 0, 0xC0, 0x7F],
        1 => &[0, 0x7E],
        ty => panic!("the last tensor is of type {ty}, neither F32 nor F16"),
    };
    wrong[data_start + offset..data_start + offset + nan.len()].copy_from_slice(nan);
    refuse("shape.gguf", &wrong, "the config implies");

    // A tensor renamed as an earlier one of a name as long (attn_q and attn_k of a block).
    let (k, later) = infos
        .iter()
        .enumerate()
        .skip(1)
        .find(|(k, (n, _))| infos[..*k].iter().any(|(m, _)| m.len() == n.len()))
        .expect("two names of one length");
    let earlier = infos[..k]
        .iter()
        .find(|(m, _)| m.len() == later.0.len())
        .unwrap();
    let mut twice = bytes.clone();
    twice[later.1 - later.0.len()..later.1].copy_from_slice(earlier.0.as_bytes());
    refuse("twice.gguf", &twice, "appears twice");
    let _ = std::fs::remove_dir_all(&work);
}
