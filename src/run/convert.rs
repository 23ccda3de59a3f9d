//! Checkpoints in and out: Hugging Face model directories (Llama, Mistral, Qwen2, Qwen3, OLMo-2),
//! llama.cpp GGUF files (`run::gguf`) and plain PyTorch state dicts become attnsweep checkpoints; trained full-attention or
//! sliding-window models go back to the Hugging Face layout.
//!
//! Parameter names are the same on both sides (the model keeps Hugging Face's), so converting
//! is checking and copying: every source tensor must be consumed, every parameter filled, every
//! shape right, or nothing is written. Safetensors files are memory-mapped and written one
//! tensor at a time, so converting needs little more memory than the largest tensor.

use crate::config::{Config, Method, ModelConfig, NormPlacement, QkNorm, RopeScaling};
use crate::io::gguf;
use crate::io::pickle;
use crate::io::pickle::Format;
use crate::model::manifest;
use crate::run::gguf::FromGguf;
use crate::run::memory;
use crate::run::LoadedRun;
use crate::util::atomic;
use crate::util::progress::Ticks;
use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, View};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// The dtype written: as in the source, or converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    Keep,
    Fp32,
    Bf16,
    Fp16,
}

impl OutDtype {
    pub(crate) fn parse(s: &str) -> Result<OutDtype> {
        Ok(match s {
            "keep" => OutDtype::Keep,
            "fp32" => OutDtype::Fp32,
            "bf16" => OutDtype::Bf16,
            "fp16" => OutDtype::Fp16,
            _ => bail!("--dtype {s:?}: expected keep, fp32, bf16 or fp16"),
        })
    }
    fn target(self, src: Dtype) -> Dtype {
        match self {
            OutDtype::Keep => src,
            OutDtype::Fp32 => Dtype::F32,
            OutDtype::Bf16 => Dtype::BF16,
            OutDtype::Fp16 => Dtype::F16,
        }
    }
}

fn kind_of(d: Dtype) -> Result<Kind> {
    Ok(match d {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        other => {
            bail!("tensors of dtype {other:?} (quantized or integer weights) cannot be converted")
        }
    })
}

/// The model families this converter knows, by Hugging Face architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Olmo2,
}

impl Family {
    fn from_architecture(a: &str) -> Result<Family> {
        Ok(match a {
            "LlamaForCausalLM" => Family::Llama,
            "MistralForCausalLM" => Family::Mistral,
            "Qwen2ForCausalLM" => Family::Qwen2,
            "Qwen3ForCausalLM" => Family::Qwen3,
            "Olmo2ForCausalLM" => Family::Olmo2,
            other => bail!(
                "architecture {other:?} is not supported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Olmo2ForCausalLM)"
            ),
        })
    }
    fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Olmo2 => "Olmo2ForCausalLM",
        }
    }
    fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Olmo2 => "olmo2",
        }
    }
}

/// `[model]` from a Hugging Face config.json, and the sliding window it declares, if any.
pub(crate) fn model_from_hf(v: &Value) -> Result<(Family, ModelConfig, Option<usize>)> {
    let arch = v["architectures"]
        .get(0)
        .and_then(|a| a.as_str())
        .context("config.json has no architectures entry")?;
    let family = Family::from_architecture(arch)?;
    let int = |k: &str| -> Result<usize> {
        v[k].as_u64()
            .map(|x| x as usize)
            .with_context(|| format!("config.json lacks integer {k}"))
    };
    let act = v["hidden_act"].as_str().unwrap_or("silu");
    ensure!(
        act == "silu",
        "config.json: hidden_act {act:?} is not supported (silu)"
    );
    ensure!(
        !v["mlp_bias"].as_bool().unwrap_or(false),
        "config.json: mlp_bias = true is not supported"
    );
    let heads = int("num_attention_heads")?;
    // transformers 5 writes the rotary settings, theta included, as rope_parameters; earlier
    // versions as rope_theta and rope_scaling.
    let (rope, rope_key) = match (&v["rope_parameters"], &v["rope_scaling"]) {
        (Value::Null, r) => (r, "rope_scaling"),
        (p, Value::Null) => (p, "rope_parameters"),
        _ => bail!("config.json has both rope_parameters and rope_scaling"),
    };
    let rope_scaling = match rope {
        Value::Null => None,
        r => {
            let t = r["rope_type"]
                .as_str()
                .or(r["type"].as_str())
                .with_context(|| format!("config.json: {rope_key} without a type"))?;
            if t == "default" {
                None
            } else {
                Some(RopeScaling {
                    rope_type: t.to_string(),
                    factor: r["factor"]
                        .as_f64()
                        .with_context(|| format!("config.json: {rope_key} without factor"))?,
                    low_freq_factor: r["low_freq_factor"].as_f64(),
                    high_freq_factor: r["high_freq_factor"].as_f64(),
                    original_max_position_embeddings: r["original_max_position_embeddings"]
                        .as_f64(),
                })
            }
        }
    };
    let m = ModelConfig {
        vocab_size: int("vocab_size")?,
        hidden_size: int("hidden_size")?,
        intermediate_size: int("intermediate_size")?,
        num_hidden_layers: int("num_hidden_layers")?,
        num_attention_heads: heads,
        num_key_value_heads: v["num_key_value_heads"]
            .as_u64()
            .map_or(heads, |x| x as usize),
        head_dim: v["head_dim"].as_u64().map_or(0, |x| x as usize),
        rope_theta: rope["rope_theta"]
            .as_f64()
            .or(v["rope_theta"].as_f64())
            .unwrap_or(10_000.0),
        rms_norm_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6),
        attention_bias: match family {
            // Qwen2 always has q, k, v biases.
            Family::Qwen2 => true,
            _ => v["attention_bias"].as_bool().unwrap_or(false),
        },
        tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
        initializer_range: v["initializer_range"].as_f64().unwrap_or(0.02),
        qk_norm: match family {
            Family::Qwen3 => QkNorm::PerHead,
            Family::Olmo2 => QkNorm::Full,
            _ => QkNorm::None,
        },
        norm_placement: if family == Family::Olmo2 {
            NormPlacement::Post
        } else {
            NormPlacement::Pre
        },
        rope_scaling,
    };
    if family == Family::Llama && m.attention_bias {
        bail!("config.json: Llama with attention_bias = true also biases o_proj, which is not supported");
    }
    let window = match family {
        Family::Mistral => v["sliding_window"].as_u64().map(|w| w as usize),
        Family::Qwen2 | Family::Qwen3 if v["use_sliding_window"].as_bool().unwrap_or(false) => {
            bail!("config.json: Qwen sliding-window layers (use_sliding_window = true) are not supported")
        }
        _ => None,
    };
    Ok((family, m, window))
}

/// The safetensors weight files of a model directory or a single weight file. A PyTorch
/// checkpoint (`pytorch_model.bin`, a `.pt` of `torch.save`, a TorchScript archive, a tch
/// `.ot`) is read in-process (`crate::io::pickle`; Python only with `allow_pickle`, for what
/// that refuses) and its tensors, a wrapper around the state dict removed, rewritten as one
/// safetensors file in `scratch`.
fn weight_files(
    src: &Path,
    allow_pickle: bool,
    scratch: &Path,
    expected: &[String],
) -> Result<Vec<PathBuf>> {
    let file = if src.is_file() {
        src.to_path_buf()
    } else if src.join("model.safetensors.index.json").is_file() {
        let idx_path = src.join("model.safetensors.index.json");
        let idx: Value = serde_json::from_str(&std::fs::read_to_string(&idx_path)?)
            .with_context(|| format!("{} is malformed", idx_path.display()))?;
        let map = idx["weight_map"]
            .as_object()
            .with_context(|| format!("{} has no weight_map", idx_path.display()))?;
        let mut shards: Vec<String> = map
            .values()
            .filter_map(|s| s.as_str().map(String::from))
            .collect();
        shards.sort();
        shards.dedup();
        return Ok(shards.into_iter().map(|s| src.join(s)).collect());
    } else if src.join("model.safetensors").is_file() {
        src.join("model.safetensors")
    } else if src.join("pytorch_model.bin").is_file() {
        src.join("pytorch_model.bin")
    } else {
        bail!(
            "{} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin",
            src.display()
        );
    };
    // A `.safetensors` name is taken at its word; other files are told by their contents.
    let named_safetensors = file.extension().is_some_and(|e| e == "safetensors");
    if named_safetensors || pickle::format(&file)? == Format::Safetensors {
        return Ok(vec![file]);
    }
    let tensors = pickle::read_checkpoint(&file, allow_pickle, scratch)?;
    let tensors = pickle::unwrap_state_dict(tensors.into_iter().collect(), expected)?;
    let out = scratch.join("from_checkpoint.safetensors");
    Tensor::write_safetensors(&tensors, &out)
        .with_context(|| format!("rewriting the tensors of {}", file.display()))?;
    Ok(vec![out])
}

/// A source tensor, read from its memory map and converted to the output dtype when written.
struct Lazy<'a> {
    bytes: &'a [u8],
    shape: Vec<usize>,
    src: Dtype,
    dst: Dtype,
    ticks: &'a Ticks,
}

impl View for Lazy<'_> {
    fn dtype(&self) -> Dtype {
        self.dst
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        self.ticks.tick();
        if self.src == self.dst {
            return Cow::Borrowed(self.bytes);
        }
        let shape: Vec<i64> = self.shape.iter().map(|&s| s as i64).collect();
        let t = Tensor::from_data_size(self.bytes, &shape, kind_of(self.src).expect("checked"))
            .to_kind(kind_of(self.dst).expect("checked"));
        let mut out = vec![0u8; self.data_len()];
        t.copy_data_u8(&mut out, t.numel());
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dst.size()
    }
}

#[derive(Debug)]
pub struct ConvertReport {
    pub(crate) family: Family,
    pub(crate) tensors: usize,
    pub(crate) parameters: u64,
    pub(crate) config: PathBuf,
}

fn mmap(path: &Path) -> Result<Mmap> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // Safety: the file is only read, and the map lives while its bytes are used.
    unsafe { Mmap::map(&f) }.with_context(|| format!("cannot map {}", path.display()))
}

/// Converts a Hugging Face model directory (or a weight file with `config`) into `out`:
/// `model.safetensors`, `config.toml` (the `[model]` section filled in, full attention), and
/// the tokenizer files when the source has them.
pub fn convert(
    src: &Path,
    config: Option<&Path>,
    out: &Path,
    dtype: OutDtype,
    allow_pickle: bool,
) -> Result<ConvertReport> {
    ensure!(
        !out.join("model.safetensors").exists() && !out.join("config.toml").exists(),
        "{} already holds a model; choose another --out",
        out.display()
    );
    // A GGUF file carries its config and tokenizer; it becomes what a Hugging Face directory
    // holds, and is converted as one.
    let from_gguf = if src.is_file() && (gguf::is_gguf(src) || named_gguf(src)) {
        ensure!(
            config.is_none(),
            "{} is a GGUF file, which carries its own config: leave out --config",
            src.display()
        );
        Some(super::gguf::read(src).with_context(|| format!("converting {}", src.display()))?)
    } else {
        None
    };
    let (family, cfg) = match &from_gguf {
        Some(g) => hf_config(&g.config, src)?,
        None => read_hf_config(src, config)?,
    };
    let scratch = Scratch::new()?;
    // What this conversion wrote into `out`, removed if it fails before the end: a later
    // attempt would otherwise find weights without a config, and refuse the directory.
    let mut written: Vec<PathBuf> = Vec::new();
    let (files, tokenizer) = match from_gguf {
        Some(g) => (gguf_weights(&g, src, &cfg, &scratch.0), g.tokenizer),
        None => (
            weight_files(src, allow_pickle, &scratch.0, &manifest_names(&cfg)),
            None,
        ),
    };
    let result = files.and_then(|files| {
        let tensors = write_weights(src, &files, out, &cfg, dtype, &mut written)?;
        match tokenizer {
            Some((json, config)) => {
                for (name, v) in [("tokenizer.json", json), ("tokenizer_config.json", config)] {
                    let text = serde_json::to_string_pretty(&v)?;
                    atomic::write_bytes(&out.join(name), text.as_bytes())?;
                    written.push(out.join(name));
                }
            }
            None => copy_tokenizer(src, out, &mut written)?,
        }
        let config_path = out.join("config.toml");
        atomic::write_bytes(&config_path, cfg.to_toml().as_bytes())?;
        Ok(ConvertReport {
            family,
            tensors: tensors.0,
            parameters: tensors.1,
            config: config_path,
        })
    });
    if result.is_err() {
        for p in &written {
            let _ = std::fs::remove_file(p);
        }
    }
    result
}

/// A `.gguf` file is read as GGUF whatever its first bytes, so a damaged one is refused for
/// what is wrong with it rather than taken for a weight file without its config.
fn named_gguf(src: &Path) -> bool {
    src.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// This conversion's scratch directory, removed however the conversion ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch> {
        let dir = std::env::temp_dir().join(format!("attnsweep-convert-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create the scratch directory {}", dir.display()))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A GGUF file's tensors checked against the model's manifest by name and shape, and the
/// memory converting the largest one takes checked, before any is read; then rewritten one
/// at a time as a safetensors file in `scratch`.
fn gguf_weights(g: &FromGguf, src: &Path, cfg: &Config, scratch: &Path) -> Result<Vec<PathBuf>> {
    let source: Sources = g
        .shapes()
        .map(|(name, d, shape)| (name.to_string(), (0, d, shape.to_vec())))
        .collect();
    check_sources(src, cfg, &source, &|name| g.stored(name))?;
    if let Some((name, bytes)) = g.peak() {
        memory::check_host(
            &format!("converting tensor {name}"),
            bytes,
            "the machine cannot convert this file",
        )?;
    }
    let file = scratch.join("from_gguf.safetensors");
    g.write_safetensors(&file)
        .with_context(|| format!("converting the tensors of {}", src.display()))?;
    Ok(vec![file])
}

/// The model a Hugging Face `config.json` describes (the directory's own, or `config` beside a
/// weight file), as a validated config: a sliding-window family converts to method `swa`.
fn read_hf_config(src: &Path, config: Option<&Path>) -> Result<(Family, Config)> {
    let cfg_path = match config {
        Some(c) => c.to_path_buf(),
        None if src.is_dir() => src.join("config.json"),
        None => bail!(
            "{} is a weight file: pass --config with its config.json",
            src.display()
        ),
    };
    let hf: Value = serde_json::from_str(
        &std::fs::read_to_string(&cfg_path)
            .with_context(|| format!("cannot read {}", cfg_path.display()))?,
    )
    .with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
    hf_config(&hf, &cfg_path)
}

/// The validated config a Hugging Face `config.json` (read from `origin`) describes.
fn hf_config(hf: &Value, origin: &Path) -> Result<(Family, Config)> {
    let (family, model, window) =
        model_from_hf(hf).with_context(|| format!("{}", origin.display()))?;
    let mut cfg = Config {
        model,
        ..Default::default()
    };
    if let Some(w) = window {
        cfg.attention.method = Method::Swa;
        cfg.attention.window = w;
    }
    cfg.validate()
        .with_context(|| format!("{} gives an invalid model", origin.display()))?;
    Ok((family, cfg))
}

fn manifest_names(cfg: &Config) -> Vec<String> {
    manifest(&cfg.model).into_iter().map(|(n, _)| n).collect()
}

/// Every tensor of the safetensors `files`, by name: the file it is in, its type and shape.
type Sources = BTreeMap<String, (usize, Dtype, Vec<usize>)>;

/// Checks the source tensors against the model's manifest (each present, of its shape and a
/// float type, nothing left over but derived buffers and a tied head stored twice), then writes
/// `model.safetensors` one tensor at a time; returns the tensors and parameters written.
fn write_weights(
    src: &Path,
    files: &[PathBuf],
    out: &Path,
    cfg: &Config,
    dtype: OutDtype,
    written: &mut Vec<PathBuf>,
) -> Result<(usize, u64)> {
    let maps: Vec<Mmap> = files.iter().map(|f| mmap(f)).collect::<Result<_>>()?;
    let parsed: Vec<SafeTensors> = maps
        .iter()
        .zip(files)
        .map(|(m, f)| {
            SafeTensors::deserialize(m).map_err(|e| {
                anyhow::anyhow!(
                    "{} is not a valid safetensors file (truncated or corrupt): {e:?}",
                    f.display()
                )
            })
        })
        .collect::<Result<_>>()?;
    let mut source: Sources = BTreeMap::new();
    for (i, st) in parsed.iter().enumerate() {
        for (name, view) in st.tensors() {
            ensure!(
                !source.contains_key(&name),
                "tensor {name} appears in two shards"
            );
            source.insert(name, (i, view.dtype(), view.shape().to_vec()));
        }
    }
    let tensor_bytes = |name: &str| -> Result<&[u8]> {
        let (i, _, _) = source[name];
        Ok(parsed[i]
            .tensor(name)
            .map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?
            .data())
    };
    check_sources(src, cfg, &source, &tensor_bytes)?;
    let expected = manifest(&cfg.model);
    atomic::ensure_writable_dir(out)?;
    let mut parameters = 0u64;
    let ticks = Ticks::new(expected.len() as u64, "tensors converted");
    let views: Vec<(String, Lazy)> = expected
        .iter()
        .map(|(n, _)| {
            let (_, d, shape) = source[n].clone();
            parameters += shape.iter().product::<usize>() as u64;
            Ok((
                n.clone(),
                Lazy {
                    bytes: tensor_bytes(n)?,
                    shape,
                    src: d,
                    dst: dtype.target(d),
                    ticks: &ticks,
                },
            ))
        })
        .collect::<Result<_>>()?;
    atomic::write_with(&out.join("model.safetensors"), |tmp| {
        safetensors::tensor::serialize_to_file(views, &None, tmp)
            .map_err(|e| anyhow::anyhow!("writing weights: {e:?}"))
    })?;
    ticks.finish();
    written.push(out.join("model.safetensors"));
    Ok((expected.len(), parameters))
}

/// Refuses `source` where it cannot fill the model (`problems`), naming every problem.
fn check_sources<'a>(
    src: &Path,
    cfg: &Config,
    source: &Sources,
    tensor_bytes: &dyn Fn(&str) -> Result<&'a [u8]>,
) -> Result<()> {
    let problems = problems(cfg, &manifest(&cfg.model), source, tensor_bytes)?;
    ensure!(
        problems.is_empty(),
        "cannot convert {}:\n  {}",
        src.display(),
        problems.join("\n  ")
    );
    Ok(())
}

/// What keeps the source tensors from filling the model: missing ones, wrong shapes, tensors
/// the model has no place for, types that are not floats.
fn problems<'a>(
    cfg: &Config,
    expected: &[(String, Vec<i64>)],
    source: &Sources,
    tensor_bytes: &dyn Fn(&str) -> Result<&'a [u8]>,
) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let missing: Vec<&str> = expected
        .iter()
        .filter(|(n, _)| !source.contains_key(n))
        .map(|(n, _)| n.as_str())
        .collect();
    if !missing.is_empty() {
        problems.push(format!("missing tensors: {missing:?}"));
    }
    for (n, shape) in expected {
        if let Some((_, _, s)) = source.get(n) {
            let s: Vec<i64> = s.iter().map(|&x| x as i64).collect();
            if &s != shape {
                problems.push(format!(
                    "tensor {n} has shape {s:?}, the config implies {shape:?}"
                ));
            }
        }
    }
    let mut unused = Vec::new();
    for name in source
        .keys()
        .filter(|n| !expected.iter().any(|(e, _)| e == *n))
    {
        // Derived buffers some checkpoints carry, and a tied head stored twice.
        if name.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        if name == "lm_head.weight"
            && cfg.model.tie_word_embeddings
            && source.contains_key("model.embed_tokens.weight")
        {
            if tensor_bytes(name)? == tensor_bytes("model.embed_tokens.weight")? {
                continue;
            }
            problems.push("lm_head.weight differs from model.embed_tokens.weight although tie_word_embeddings = true".into());
            continue;
        }
        unused.push(name.clone());
    }
    if !unused.is_empty() {
        problems.push(format!("tensors the model has no place for: {unused:?}"));
    }
    for (n, _) in expected {
        if let Some((_, d, _)) = source.get(n) {
            if let Err(e) = kind_of(*d) {
                problems.push(format!("{n}: {e}"));
            }
        }
    }
    Ok(problems)
}

/// The tokenizer files of a model directory, copied along.
fn copy_tokenizer(src: &Path, out: &Path, written: &mut Vec<PathBuf>) -> Result<()> {
    if src.is_dir() {
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            if src.join(f).is_file() {
                atomic::write_bytes(&out.join(f), &std::fs::read(src.join(f))?)?;
                written.push(out.join(f));
            }
        }
    }
    Ok(())
}

/// Writes a trained model in the Hugging Face layout: config.json (full attention as Llama,
/// Qwen2, Qwen3 or OLMo-2 by the model's features, a window as Mistral, every other method as
/// transformers' Llama with the method's attention in `modeling_attnsweep.py`, which
/// `trust_remote_code` loads), model.safetensors, and the tokenizer it reads (the run's own, which a converted
/// model keeps beside its weights, else its data set's) with a generation config, so
/// transformers' `AutoTokenizer` and `generate` work on the folder as it is. Its context is
/// the longer of what the tokenizer's config declares (`model_max_length`) and what the run
/// trained at.
pub(crate) fn export(
    run: &Path,
    ckpt: Option<&Path>,
    out: &Path,
    dtype: OutDtype,
) -> Result<PathBuf> {
    // A run directory or a conversion there would be shadowed: `resolve_weights` reads a
    // model.safetensors beside the checkpoints first.
    let taken = [
        "config.json",
        "model.safetensors",
        "config.toml",
        "checkpoints",
    ]
    .into_iter()
    .find(|n| out.join(n).exists());
    if let Some(name) = taken {
        bail!(
            "{} already holds a model or a run ({name}); choose another --out",
            out.display()
        );
    }
    let loaded = LoadedRun::open(run, &[], ckpt, false)?;
    let (m, a) = (&loaded.cfg.model, &loaded.cfg.attention);
    let family = match (m.norm_placement, m.qk_norm, m.attention_bias) {
        (NormPlacement::Post, QkNorm::Full, false) => Family::Olmo2,
        (NormPlacement::Pre, QkNorm::PerHead, _) => Family::Qwen3,
        (NormPlacement::Pre, QkNorm::None, true) => Family::Qwen2,
        (NormPlacement::Pre, QkNorm::None, false) => Family::Llama,
        _ => bail!("this combination of norms and biases matches no Hugging Face family"),
    };
    // Full attention and a Llama-style window are transformers' own models; every other
    // method is transformers' Llama with the method's attention (`modeling_attnsweep.py`).
    let native = match a.method {
        Method::Full => Some(family),
        Method::Swa if family == Family::Llama => Some(Family::Mistral),
        _ => None,
    };
    if native.is_none() {
        ensure!(
            matches!(family, Family::Llama | Family::Qwen2),
            "export writes {} models of Llama's shape (pre-norm, no q/k norms); this run's is \
             {family:?}'s",
            crate::config::name_of(a.method)
        );
        ensure!(
            !a.reads().contains(&"bernoulli_p"),
            "this run's gates are drawn at random (attention.router = \"bernoulli\"), which \
             transformers cannot draw as attnsweep does; export a learned router's run"
        );
    }
    let mut c = exported_config(&loaded.cfg, native, dtype)?;
    let tokenizer = [run, loaded.cfg.data.dir.as_path()]
        .into_iter()
        .find(|d| !d.as_os_str().is_empty() && d.join("tokenizer.json").is_file());
    c["max_position_embeddings"] = json!(context(&loaded.cfg, tokenizer));
    atomic::ensure_writable_dir(out)?;
    let target = match dtype {
        OutDtype::Keep | OutDtype::Fp32 => Kind::Float,
        OutDtype::Bf16 => Kind::BFloat16,
        OutDtype::Fp16 => Kind::Half,
    };
    let tensors: Vec<(String, Tensor)> = loaded
        .built
        .params()
        .into_iter()
        .map(|(n, t)| (n, t.to_kind(target).contiguous()))
        .collect();
    atomic::write_with(&out.join("model.safetensors"), |tmp| {
        Ok(Tensor::write_safetensors(&tensors, tmp)?)
    })?;
    if native.is_none() {
        let code = crate::model::attention::hf_modeling(a.method);
        atomic::write_bytes(&out.join("modeling_attnsweep.py"), code.as_bytes())?;
    }
    if let Some(d) = tokenizer {
        write_tokenizer(d, out, &mut c)?;
    }
    atomic::write_bytes(
        &out.join("config.json"),
        serde_json::to_string_pretty(&c)?.as_bytes(),
    )?;
    Ok(out.to_path_buf())
}

/// The config.json of a model: transformers' own family (`native`) or, for the other methods,
/// transformers' Llama with the method's attention and its settings (`attnsweep`), which
/// `modeling_attnsweep.py` reads.
fn exported_config(cfg: &Config, native: Option<Family>, dtype: OutDtype) -> Result<Value> {
    let (m, a) = (&cfg.model, &cfg.attention);
    let (architecture, model_type) = match native {
        Some(f) => (f.architecture(), f.model_type()),
        None => ("AttnsweepForCausalLM", "attnsweep"),
    };
    let mut c = json!({
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim(),
        "hidden_act": "silu",
        "rms_norm_eps": m.rms_norm_eps,
        "rope_theta": m.rope_theta,
        "tie_word_embeddings": m.tie_word_embeddings,
        "initializer_range": m.initializer_range,
        "attention_bias": m.attention_bias,
        "torch_dtype": match dtype { OutDtype::Bf16 => "bfloat16", OutDtype::Fp16 => "float16", _ => "float32" },
    });
    if let Some(r) = &m.rope_scaling {
        c["rope_scaling"] = json!({
            "rope_type": r.rope_type, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_max_position_embeddings,
        });
    }
    if native == Some(Family::Mistral) {
        c["sliding_window"] = json!(a.window);
    }
    if native.is_none() {
        c["auto_map"] = json!({
            "AutoConfig": "modeling_attnsweep.AttnsweepConfig",
            "AutoModelForCausalLM": "modeling_attnsweep.AttnsweepForCausalLM",
        });
        c["use_cache"] = json!(false);
        c["attnsweep"] = json!({
            "method": crate::config::name_of(a.method),
            "window": a.window,
            "tau": a.tau,
            "ppa_power": a.ppa_power,
            "hybrid_every": a.hybrid_every,
            "sink_tokens": a.sink_tokens,
            "pruned_layers": a.pruned_layers,
            "shared_o_proj": a.swiattn_shared_o_proj,
            // Static heads' assignment (AHA's start assignment is in its router's bias, which
            // the weights carry).
            "full_heads": match a.method {
                Method::StaticHeads => (crate::model::attention::spec(a.method).fixed_heads)(m, a)?,
                _ => None,
            }
                .map(|heads| heads.iter().map(|layer| layer.iter().map(Option::is_some).collect::<Vec<_>>()).collect::<Vec<_>>()),
        });
    }
    Ok(c)
}

/// The context a model is exported with: the longer of what its tokenizer's config declares
/// (`model_max_length`) and what the run trained and evaluated at (2,048 at least where the
/// tokenizer declares none).
fn context(cfg: &Config, tokenizer: Option<&Path>) -> u64 {
    let declared = tokenizer.and_then(|d| {
        let text = std::fs::read_to_string(d.join("tokenizer_config.json")).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        // transformers writes a huge number where a tokenizer declares no length.
        v["model_max_length"].as_u64().filter(|&n| n < 1 << 24)
    });
    let trained = cfg.data.seq_len.max(cfg.eval_seq_len()) as u64;
    declared.map_or(trained.max(2048), |d| d.max(trained))
}

/// The tokenizer files of `dir` copied into `out`, its special tokens named in the config `c`,
/// a tokenizer config where none came (transformers' fast tokenizer over the file, its end of
/// text, the model's context), and a generation config (greedy, stopping at the declared end
/// of text) where none came.
fn write_tokenizer(dir: &Path, out: &Path, c: &mut Value) -> Result<()> {
    copy_tokenizer(dir, out, &mut Vec::new())?;
    let tok = crate::data::TextTokenizer::hf(&dir.join("tokenizer.json"))?;
    let bos = tok.declared("bos_token").or(tok.bos());
    let eos = tok.declared("eos_token").or(tok.eot());
    c["bos_token_id"] = json!(bos);
    c["eos_token_id"] = json!(eos);
    if !out.join("tokenizer_config.json").exists() {
        let mut tc = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": c["max_position_embeddings"],
        });
        if let Some(name) = eos.and_then(|id| tok.id_to_token(id)) {
            tc["eos_token"] = json!(name);
        }
        atomic::write_bytes(
            &out.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&tc)?.as_bytes(),
        )?;
    }
    if !out.join("generation_config.json").exists() {
        let g = json!({"bos_token_id": bos, "eos_token_id": eos, "do_sample": false});
        atomic::write_bytes(
            &out.join("generation_config.json"),
            serde_json::to_string_pretty(&g)?.as_bytes(),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every method's model exports and runs in transformers: the logits of transformers'
    /// model loaded from the folder (`trust_remote_code`, fp32) are attnsweep's within 1e-4 on
    /// a tiny Llama-shaped model with routers whose gates open about half the time, and
    /// `generate` continues greedily as the logits say. Full attention and the window load as
    /// transformers' own Llama and Mistral.
    #[test]
    fn every_method_exports_to_transformers_with_its_logits() {
        use crate::config::{Method, Router};
        use crate::model::attention::ForwardCtx;
        let dir = crate::util::scratch_dir("export-methods");
        let ranking = dir.join("head_ranking.csv");
        let rows: Vec<String> = (0..8)
            .map(|i| format!("{},{},{},{}", i + 1, i % 2, i / 2, 1.0 - i as f64 / 8.0))
            .collect();
        std::fs::write(
            &ranking,
            format!("rank,layer,head,mu_f\n{}\n", rows.join("\n")),
        )
        .unwrap();
        tch::manual_seed(5);
        let ids = Tensor::randint(64, [2, 24], (Kind::Int64, tch::Device::Cpu));
        let mut cases = Vec::new();
        for method in Method::ALL {
            let mut c = Config::default();
            (
                c.model.vocab_size,
                c.model.hidden_size,
                c.model.intermediate_size,
            ) = (64, 64, 96);
            (c.model.num_hidden_layers, c.model.num_attention_heads) = (2, 4);
            c.model.num_key_value_heads = 2;
            c.train.device = "cpu".into();
            let a = &mut c.attention;
            (a.method, a.window, a.router) = (method, 5, Router::Learned);
            (a.ppa_power, a.hybrid_every, a.sink_tokens) = (0.5, 2, 2);
            (a.head_ranking, a.top_k) = (ranking.clone(), 3);
            c.validate().unwrap();
            let built = crate::run::Built::new(&c, tch::Device::Cpu).unwrap();
            tch::no_grad(|| {
                for (name, t) in built.params() {
                    if name.contains("router") {
                        let _ = t.shallow_clone().copy_(&(t.randn_like() * 0.5));
                    }
                }
            });
            let out = tch::no_grad(|| built.model.forward(&ids, &ForwardCtx::default()));
            // A test that cannot fail on the gates: they open about half the time.
            for g in out.layers.iter().filter_map(|l| l.gates.as_ref()) {
                let open = g.mean(Kind::Float).double_value(&[]);
                if method != Method::StaticHeads {
                    assert!((0.1..0.9).contains(&open), "{method:?}: {open}");
                }
            }
            let name = crate::config::name_of(method);
            let run = dir.join(format!("run-{name}"));
            std::fs::create_dir_all(&run).unwrap();
            std::fs::write(run.join("config.toml"), c.to_toml()).unwrap();
            let params: Vec<(String, Tensor)> = built.params().into_iter().collect();
            Tensor::write_safetensors(&params, run.join("model.safetensors")).unwrap();
            let hf = dir.join(format!("hf-{name}"));
            export(&run, None, &hf, OutDtype::Fp32).unwrap();
            let native = matches!(method, Method::Full | Method::Swa);
            assert_eq!(hf.join("modeling_attnsweep.py").exists(), !native, "{name}");
            cases.push((name, hf, out.logits));
        }
        let script = r#"
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
ids = torch.tensor(eval(sys.argv[1]))
for path in sys.argv[2:]:
    m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, torch_dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        logits = m(ids).logits.float()
        steps = m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        greedy = ids
        for _ in range(3):
            nxt = m(greedy).logits[:, -1].argmax(-1, keepdim=True)
            greedy = torch.cat([greedy, nxt], 1)
    assert torch.equal(steps, greedy), (path, steps, greedy)
    save_file({"logits": logits.contiguous()}, path + "/logits.safetensors")
"#;
        let py = std::env::var("ATTNSWEEP_PYTHON").unwrap_or_else(|_| "python3".into());
        let ids_text = format!("{:?}", Vec::<Vec<i64>>::try_from(&ids).unwrap());
        let o = std::process::Command::new(py)
            .args(["-c", script, &ids_text])
            .args(cases.iter().map(|c| c.1.clone()))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        for (name, hf, ours) in &cases {
            let theirs = Tensor::read_safetensors(hf.join("logits.safetensors")).unwrap();
            let theirs = &theirs[0].1;
            let err = (ours - theirs).norm().double_value(&[]) / ours.norm().double_value(&[]);
            assert!(
                err < 1e-4,
                "{name}: transformers' logits differ by {err:.2e} (relative)"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A config of transformers 5 (rotary settings under rope_parameters) converts as the
    /// same config of transformers 4 does (rope_theta and rope_scaling).
    #[test]
    fn rope_parameters_read_as_rope_theta_and_rope_scaling() {
        let base = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        });
        let with = |extra: Value| {
            let mut v = base.clone();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            model_from_hf(&v)
        };
        let scaling = serde_json::json!({
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        });
        let v4 = with(serde_json::json!({"rope_theta": 500000.0, "rope_scaling": scaling}))
            .unwrap()
            .1;
        let mut params = scaling.clone();
        params["rope_theta"] = serde_json::json!(500000.0);
        let v5 = with(serde_json::json!({ "rope_parameters": params }))
            .unwrap()
            .1;
        assert_eq!(v5.rope_theta, 500000.0);
        assert_eq!(v5.rope_scaling, v4.rope_scaling);
        assert_eq!(v5.rope_scaling.unwrap().rope_type, "llama3");
        let plain = with(serde_json::json!({
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}
        }))
        .unwrap()
        .1;
        assert_eq!((plain.rope_theta, plain.rope_scaling), (1e6, None));
        let both = with(serde_json::json!({"rope_parameters": params, "rope_scaling": scaling}));
        assert!(format!("{:#}", both.unwrap_err()).contains("both rope_parameters"));
    }
}
