//! Mutation fuzzing of every parser of user-supplied input: experiment configs and `--set`
//! overrides, grid files, token shards, data-set metadata, safetensors checkpoints (our loader
//! and the converter) and multiple-choice JSONL files. Each starts from valid inputs and applies
//! random byte-level edits; every outcome must be a value or an error, never a panic.
//! `ATTNSWEEP_LONG_TESTS=1` multiplies the counts by 20.

mod common;

use attnsweep::config::{Config, ModelConfig};
use attnsweep::util::rng::Rng;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn scratch(name: &str) -> PathBuf {
    common::scratch("fuzz", name)
}

fn count(short: usize) -> usize {
    if std::env::var("ATTNSWEEP_LONG_TESTS").is_ok_and(|v| v == "1") {
        short * 20
    } else {
        short
    }
}

/// Bytes that tend to matter to the formats under test.
const SPECIAL: &[u8] = b"\0\xff\"[]{}=.,:\n-0123456789eE";

/// One to eight random edits: flips, special bytes, insertions, deletions, duplications,
/// truncation, and overwrites of a 4- or 8-byte field with an extreme integer.
fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(8) {
        let at = |rng: &mut Rng, v: &Vec<u8>| rng.below(v.len() as u64 + 1) as usize;
        match rng.below(7) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len() as u64) as usize;
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len() as u64) as usize;
                v[i] = SPECIAL[rng.below(SPECIAL.len() as u64) as usize];
            }
            2 => {
                let i = at(rng, &v);
                let b = SPECIAL[rng.below(SPECIAL.len() as u64) as usize];
                v.insert(i, b);
            }
            3 if !v.is_empty() => {
                let i = rng.below(v.len() as u64) as usize;
                let n = (rng.below(16) as usize).min(v.len() - i);
                v.drain(i..i + n);
            }
            4 if !v.is_empty() => {
                let i = rng.below(v.len() as u64) as usize;
                let n = (rng.below(32) as usize).min(v.len() - i);
                let piece: Vec<u8> = v[i..i + n].to_vec();
                let j = at(rng, &v);
                v.splice(j..j, piece);
            }
            5 => {
                let n = at(rng, &v);
                v.truncate(n);
            }
            _ if v.len() >= 8 => {
                let i = rng.below(v.len() as u64 - 7) as usize;
                let extreme = [
                    0u64,
                    1,
                    u32::MAX as u64,
                    i32::MAX as u64,
                    u64::MAX,
                    1 << 40,
                    rng.next_u64(),
                ];
                let x = extreme[rng.below(extreme.len() as u64) as usize];
                let w = if rng.below(2) == 0 { 4 } else { 8 };
                v[i..i + w].copy_from_slice(&x.to_le_bytes()[..w]);
            }
            _ => {}
        }
    }
    v
}

/// Feeds `n` mutants of each seed through `parse` (after writing them to `path`); a panic
/// fails the test with the input kept beside it for reproduction.
fn campaign(name: &str, seeds: &[Vec<u8>], path: &Path, n: usize, mut parse: impl FnMut(&Path)) {
    let mut rng = Rng::new(0xF022 ^ name.len() as u64);
    let start = Instant::now();
    for i in 0..n {
        let input = mutate(&mut rng, &seeds[i % seeds.len()]);
        std::fs::write(path, &input).unwrap();
        if catch_unwind(AssertUnwindSafe(|| parse(path))).is_err() {
            let keep = path.with_extension("panic");
            std::fs::write(&keep, &input).unwrap();
            panic!("{name}: input {i} panicked; kept in {}", keep.display());
        }
    }
    eprintln!(
        "fuzz {name}: {n} inputs in {:.1} s, no panic",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn config_files_and_overrides() {
    let dir = scratch("config");
    let mut full = Config::default();
    full.data.dir = "data/x".into();
    full.attention.pruned_layers = vec![1];
    full.eval.tasks = vec!["niah_single".into()];
    let seeds = vec![
        full.to_toml().into_bytes(),
        b"[model]\nhidden_size = 64\n[attention]\nmethod = \"aha\"\nwindow = 16\n".to_vec(),
    ];
    campaign("config", &seeds, &dir.join("c.toml"), count(20_000), |p| {
        let _ = Config::load(Some(p), &[]);
    });
    let sets = vec![
        b"attention.window=32".to_vec(),
        b"eval.lengths=[128, 256]".to_vec(),
        b"model.rope_scaling.factor=8.0".to_vec(),
    ];
    campaign("--set", &sets, &dir.join("s.txt"), count(20_000), |p| {
        let s = String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned();
        let _ = Config::load(None, &[s]);
    });
}

#[test]
fn grid_files() {
    let dir = scratch("grid");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("sweeps");
    let seeds: Vec<Vec<u8>> = ["demo.toml", "l2a_threshold.toml"]
        .iter()
        .filter_map(|f| std::fs::read(root.join(f)).ok())
        .collect();
    assert!(!seeds.is_empty());
    campaign("grid", &seeds, &dir.join("g.toml"), count(10_000), |p| {
        if let Ok(g) = attnsweep::sweep::read_grid(p) {
            let _ = attnsweep::sweep::expand(&g);
        }
    });
}

#[test]
fn token_shards_and_metadata() {
    use attnsweep::data::{read_meta, write_shard, Shard, Width, TOKENS_MAGIC};
    let dir = scratch("shard");
    let good = dir.join("good.bin");
    let mut seeds = Vec::new();
    for (w, vals) in [
        (Width::U16, (0..300u32).collect::<Vec<_>>()),
        (Width::U32, vec![70_000, 1, 2]),
    ] {
        write_shard(&good, TOKENS_MAGIC, w, &vals).unwrap();
        seeds.push(std::fs::read(&good).unwrap());
    }
    campaign("shard", &seeds, &dir.join("s.bin"), count(10_000), |p| {
        if let Ok(s) = Shard::open(p, TOKENS_MAGIC) {
            // Every index the header admits must be inside the file.
            let sum: u64 = (0..s.len()).map(|i| s.get(i) as u64).sum();
            std::hint::black_box(sum);
        }
    });
    let meta = br#"{"format": 1, "tokenizer": "byte", "vocab_size": 257, "eot_token": 256,
        "train": ["train_000.bin"], "val": ["val_000.bin"], "train_tokens": 10, "val_tokens": 5,
        "synth": null}"#;
    let mdir = dir.join("meta");
    std::fs::create_dir_all(&mdir).unwrap();
    campaign(
        "meta.json",
        &[meta.to_vec()],
        &mdir.join("meta.json"),
        count(10_000),
        |_| {
            let _ = read_meta(&mdir);
        },
    );
}

fn tiny_model() -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        hidden_size: 8,
        intermediate_size: 16,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        ..Default::default()
    }
}

#[test]
fn safetensors_checkpoints_and_conversion() {
    let dir = scratch("safetensors");
    let src = dir.join("hf");
    std::fs::create_dir_all(&src).unwrap();
    let tensors: Vec<(String, tch::Tensor)> = attnsweep::model::manifest(&tiny_model())
        .into_iter()
        .map(|(n, shape)| {
            (
                n,
                tch::Tensor::ones(shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu)),
            )
        })
        .collect();
    let good = dir.join("good.safetensors");
    tch::Tensor::write_safetensors(&tensors, &good).unwrap();
    let seeds = vec![std::fs::read(&good).unwrap()];
    campaign(
        "checkpoint safetensors",
        &seeds,
        &dir.join("m.safetensors"),
        count(5_000),
        |p| {
            let _ = attnsweep::io::checkpoint::read_tensors(p);
        },
    );
    std::fs::write(
        src.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
            "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 11, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    // The unmutated model converts, so the campaign explores past the first checks.
    std::fs::copy(&good, src.join("model.safetensors")).unwrap();
    attnsweep::run::convert::convert(
        &src,
        None,
        &dir.join("out-good"),
        attnsweep::run::convert::OutDtype::Keep,
        false,
    )
    .unwrap();
    let mut k = 0;
    campaign(
        "convert safetensors",
        &seeds,
        &src.join("model.safetensors"),
        count(2_000),
        |_| {
            k += 1;
            let out = dir.join(format!("out-{k}"));
            let _ = attnsweep::run::convert::convert(
                &src,
                None,
                &out,
                attnsweep::run::convert::OutDtype::Keep,
                false,
            );
            let _ = std::fs::remove_dir_all(&out);
        },
    );
}

#[test]
fn multiple_choice_files() {
    let dir = scratch("mc");
    let seeds = vec![
        br#"{"context": "The sky is", "choices": ["blue", "green"], "gold": 0}
{"context": "2 + 2 =", "choices": ["4", "5", "22"], "gold": 0, "target_delimiter": " "}
"#
        .to_vec(),
    ];
    campaign("jsonl", &seeds, &dir.join("t.jsonl"), count(20_000), |p| {
        let _ = attnsweep::run::choice::read_mc(p);
    });
}
