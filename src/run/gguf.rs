//! What a llama.cpp GGUF file becomes in Hugging Face terms: a `config.json`, the tensors
//! under Hugging Face's names (dequantised, Q and K back in Hugging Face's row order), and the
//! tokenizer as a `tokenizer.json` with its `tokenizer_config.json`. `convert` then checks and
//! writes them as it does a Hugging Face directory.
//!
//! Read: the `llama` (Llama, Mistral, SmolLM), `qwen2` and `qwen3` architectures, and BPE
//! tokenizers (`tokenizer.ggml.model = "gpt2"`) with the pre-tokenizers of those families.
//! Where transformers' own GGUF loader and the file disagree, the file is followed:
//! transformers builds every Llama-architecture tokenizer with a post-processor that prepends
//! BOS, where the file may say `tokenizer.ggml.add_bos_token = false` (SmolLM2's does), and it
//! drops the pre-tokenizer the file names (`tokenizer.ggml.pre`), so SmolLM2's digits, which
//! llama.cpp and the model's own tokenizer split one by one, stay grouped there.

use crate::io::gguf::{GgmlType, Gguf, Value as G};
use crate::util::progress::Ticks;
use anyhow::{bail, ensure, Context, Result};
use safetensors::tensor::{Dtype, View};
use serde_json::{json, Map, Value};
use std::borrow::Cow;
use std::cell::RefCell;
use std::path::Path;
use tch::Tensor;

/// A GGUF file's model and tokenizer, as a Hugging Face directory would hold them. The
/// tensors stay in the file until `write_safetensors` converts them, one at a time.
pub(crate) struct FromGguf {
    /// `config.json`'s contents.
    pub(crate) config: Value,
    /// `tokenizer.json` and `tokenizer_config.json`, when the file has a tokenizer.
    pub(crate) tokenizer: Option<(Value, Value)>,
    gguf: Gguf,
    /// The file's tensors in its order: each one's Hugging Face name, and for Llama's Q and K
    /// the head count whose rotary rows are restored.
    tensors: Vec<(String, Option<usize>)>,
}

/// The architectures read, with their Hugging Face class.
fn hf_architecture(arch: &str) -> Result<&'static str> {
    Ok(match arch {
        "llama" => "LlamaForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        other => bail!(
            "general.architecture = {other:?} is not supported; supported: llama (Llama, Mistral, SmolLM), qwen2, qwen3"
        ),
    })
}

/// The metadata and tensor infos of a GGUF file, checked; no tensor is read yet.
pub(crate) fn read(path: &Path) -> Result<FromGguf> {
    let g = Gguf::open(path)?;
    let arch = g
        .typed("general.architecture", "a string", G::as_str)?
        .context("the file has no general.architecture")?
        .to_string();
    let (mut config, heads, kv_heads) = config(&g, &arch)?;
    let mut tensors = Vec::with_capacity(g.tensors.len());
    for info in &g.tensors {
        let name = hf_name(&info.name)?;
        // llama.cpp interleaves the rotary halves of each Llama head's Q and K rows
        // (convert_hf_to_gguf.py's `permute`); they are restored to Hugging Face's order.
        let rotary = match () {
            _ if arch != "llama" => None,
            _ if name.ends_with("q_proj.weight") => Some(heads),
            _ if name.ends_with("k_proj.weight") => Some(kv_heads),
            _ => None,
        };
        tensors.push((name, rotary));
    }
    let tied = !g.tensors.iter().any(|t| t.name == "output.weight");
    config["tie_word_embeddings"] = json!(tied);
    let tokenizer = match g.get("tokenizer.ggml.model") {
        None => None,
        Some(_) => Some(tokenizer(&g, &config)?),
    };
    Ok(FromGguf {
        config,
        tokenizer,
        gguf: g,
        tensors,
    })
}

/// The safetensors type a tensor is converted to: F16 and BF16 as stored, every other type
/// (quantised ones dequantised) fp32.
fn dtype(ty: GgmlType) -> Dtype {
    match ty {
        GgmlType::F16 => Dtype::F16,
        GgmlType::Bf16 => Dtype::BF16,
        _ => Dtype::F32,
    }
}

impl FromGguf {
    /// Each tensor's Hugging Face name, the type it converts to, and its shape: what the
    /// model's manifest is checked against before any tensor is read.
    pub(crate) fn shapes(&self) -> impl Iterator<Item = (&str, Dtype, &[usize])> {
        self.tensors
            .iter()
            .zip(&self.gguf.tensors)
            .map(|((name, _), info)| (name.as_str(), dtype(info.ty), info.shape.as_slice()))
    }

    /// Tensor `name`'s bytes as stored (to compare a head stored twice with the embedding).
    pub(crate) fn stored(&self, name: &str) -> Result<&[u8]> {
        let i = self
            .tensors
            .iter()
            .position(|(n, _)| n == name)
            .with_context(|| format!("the file has no tensor {name}"))?;
        Ok(self.gguf.raw(&self.gguf.tensors[i]))
    }

    /// The largest tensor (its GGUF name) and the host memory converting it takes: its fp32
    /// values about four times over (dequantised, as a tensor, its rows restored, written).
    pub(crate) fn peak(&self) -> Option<(&str, f64)> {
        self.gguf
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    16.0 * t.shape.iter().product::<usize>() as f64,
                )
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// Tensor `index` of the file, read and its rows restored.
    fn tensor(&self, index: usize) -> Result<Tensor> {
        let info = &self.gguf.tensors[index];
        let t = self.gguf.tensor(info)?;
        match self.tensors[index].1 {
            Some(heads) => unpermute(&t, heads).with_context(|| format!("tensor {}", info.name)),
            None => Ok(t),
        }
    }

    /// Writes every tensor under its Hugging Face name as the safetensors file `path`,
    /// converting one at a time.
    pub(crate) fn write_safetensors(&self, path: &Path) -> Result<()> {
        let failed = RefCell::new(None);
        let ticks = Ticks::new(self.tensors.len() as u64, "tensors converted");
        let views = self.tensors.iter().enumerate().map(|(i, (name, _))| {
            let info = &self.gguf.tensors[i];
            let view = OneTensor {
                from: self,
                index: i,
                dtype: dtype(info.ty),
                shape: &info.shape,
                failed: &failed,
                ticks: &ticks,
            };
            (name.clone(), view)
        });
        let written = safetensors::tensor::serialize_to_file(views, &None, path);
        ticks.finish();
        if let Some(e) = failed.into_inner() {
            return Err(e);
        }
        written.map_err(|e| anyhow::anyhow!("writing {}: {e:?}", path.display()))
    }
}

/// One tensor of the file, read when the writer asks for its bytes. A tensor that cannot be
/// read leaves its error in `failed` (the writer's interface has no place for one) and zeros
/// in the file, which is then not used.
struct OneTensor<'a> {
    from: &'a FromGguf,
    index: usize,
    dtype: Dtype,
    shape: &'a [usize],
    failed: &'a RefCell<Option<anyhow::Error>>,
    ticks: &'a Ticks,
}

impl View for OneTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut out = vec![0u8; self.data_len()];
        if self.failed.borrow().is_none() {
            match self.from.tensor(self.index) {
                Ok(t) => t.copy_data_u8(&mut out, t.numel()),
                Err(e) => *self.failed.borrow_mut() = Some(e),
            }
        }
        self.ticks.tick();
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

fn unpermute(t: &Tensor, heads: usize) -> Result<Tensor> {
    let size = t.size();
    let rows = size[0] as usize;
    ensure!(
        heads > 0 && rows % (2 * heads) == 0,
        "{rows} rows do not split into {heads} heads of rotary pairs"
    );
    let half = (rows / heads / 2) as i64;
    Ok(t.reshape([heads as i64, half, 2, -1])
        .transpose(1, 2)
        .reshape(size.as_slice()))
}

/// llama.cpp's tensor names (`llama-arch.cpp`) to Hugging Face's. A name not in the table
/// keeps its GGUF name, and `convert` lists it among the tensors the model has no place for.
fn hf_name(gguf: &str) -> Result<String> {
    let top = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        "rope_freqs.weight" => bail!(
            "rope_freqs.weight (Llama 3.1's rotary scaling, stored as frequencies) is not supported from GGUF: convert the Hugging Face checkpoint instead"
        ),
        _ => None,
    };
    if let Some(t) = top {
        return Ok(t.into());
    }
    let Some(rest) = gguf.strip_prefix("blk.") else {
        return Ok(gguf.into());
    };
    let Some((layer, part)) = rest.split_once('.') else {
        return Ok(gguf.into());
    };
    let (module, suffix) = part.rsplit_once('.').unwrap_or((part, ""));
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return Ok(gguf.into()),
    };
    Ok(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// `config.json` from the `<arch>.*` metadata, and the query and key-value head counts.
fn config(g: &Gguf, arch: &str) -> Result<(Value, usize, usize)> {
    let class = hf_architecture(arch)?;
    let key = |k: &str| format!("{arch}.{k}");
    let int = |k: &str| -> Result<Option<usize>> {
        match g.get(&key(k)) {
            None => Ok(None),
            Some(v) => v
                .as_int()
                .filter(|&i| i > 0 && i <= u32::MAX as i128)
                .map(|i| Some(i as usize))
                .with_context(|| format!("{} = {v:?}: expected a positive integer", key(k))),
        }
    };
    let need = |k: &str| -> Result<usize> {
        int(k)?.with_context(|| format!("the file has no {}", key(k)))
    };
    let float = |k: &str| -> Result<Option<f64>> {
        match g.get(&key(k)) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .with_context(|| format!("{} = {v:?}: expected a finite number", key(k))),
        }
    };
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let kv_heads = int("attention.head_count_kv")?.unwrap_or(heads);
    let vocab = match int("vocab_size")? {
        Some(v) => v,
        None => g
            .typed("tokenizer.ggml.tokens", "an array", G::as_array)?
            .map(|a| a.len())
            .context("the file has neither a vocab_size nor tokenizer.ggml.tokens")?,
    };
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(arch));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert(
        "intermediate_size".into(),
        json!(need("feed_forward_length")?),
    );
    c.insert("num_hidden_layers".into(), json!(need("block_count")?));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(kv_heads));
    if let Some(n) = int("context_length")? {
        c.insert("max_position_embeddings".into(), json!(n));
    }
    // Qwen3's head is wider than hidden / heads; llama.cpp says so in key_length.
    if let Some(d) = int("attention.key_length")? {
        c.insert("head_dim".into(), json!(d));
    }
    c.insert(
        "rms_norm_eps".into(),
        json!(float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6)),
    );
    c.insert(
        "rope_theta".into(),
        json!(float("rope.freq_base")?.unwrap_or(10_000.0)),
    );
    match g.typed(&key("rope.scaling.type"), "a string", G::as_str)? {
        None | Some("none") => {}
        Some("linear") => {
            let factor = float("rope.scaling.factor")?
                .context("rope.scaling.type = linear without rope.scaling.factor")?;
            c.insert(
                "rope_scaling".into(),
                json!({"rope_type": "linear", "factor": factor}),
            );
        }
        Some(t) => bail!(
            "{} = {t:?} is not supported (none, linear)",
            key("rope.scaling.type")
        ),
    }
    for (ours, theirs) in [
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ] {
        if let Some(i) = g.typed(ours, "an integer", G::as_int)? {
            c.insert(theirs.into(), json!(i as i64));
        }
    }
    Ok((Value::Object(c), heads, kv_heads))
}

/// The pre-tokenizers read, by `tokenizer.ggml.pre`, as llama.cpp's `llama-vocab.cpp`
/// applies them: the patterns split by before the byte-level step, and whether that step
/// still applies GPT-2's own pattern after them.
fn pre_split(pre: &str) -> Result<(Vec<&'static str>, bool)> {
    // Llama 3's and Qwen2's word pattern, which replace GPT-2's; they differ in how digits
    // group.
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Ok(match pre {
        "default" | "gpt2" => (vec![], true),
        // Every digit alone, then GPT-2's pattern.
        "smollm" => (vec![r"\p{N}"], true),
        "llama-bpe" | "llama3" => (vec![LLAMA3], false),
        "qwen2" => (vec![QWEN2], false),
        other => bail!(
            "tokenizer.ggml.pre = {other:?} is not supported; supported: default, gpt2, smollm, llama-bpe, qwen2"
        ),
    })
}

/// The pre-tokenizers of the file's pre-tokenizer name (`tokenizer.ggml.pre`): its splits,
/// then the byte-level one.
fn pre_tokenizers(g: &Gguf) -> Result<Vec<Value>> {
    let pre = g
        .typed("tokenizer.ggml.pre", "a string", G::as_str)?
        .unwrap_or("default");
    let (splits, gpt2_pattern) = pre_split(pre)?;
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": true, "use_regex": gpt2_pattern});
    let mut pre_tokenizers: Vec<Value> = splits
        .iter()
        .map(|r| {
            json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
                   "invert": false})
        })
        .collect();
    pre_tokenizers.push(byte_level);
    Ok(pre_tokenizers)
}

/// The post-processor: the BOS token (id, text) before each sequence where the file adds it,
/// else the byte-level one.
fn post_processor(bos: &Option<(usize, String)>, add_bos: bool) -> Result<Value> {
    Ok(match (bos, add_bos) {
        (Some((id, t)), true) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": t, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {t: {"id": t, "ids": [id], "tokens": [t]}},
        }),
        (None, true) => {
            bail!("tokenizer.ggml.add_bos_token = true but the file has no bos_token_id")
        }
        _ => json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                    "use_regex": true}),
    })
}

/// `tokenizer.json` and `tokenizer_config.json` from the `tokenizer.*` metadata.
fn tokenizer(g: &Gguf, config: &Value) -> Result<(Value, Value)> {
    let model = g
        .typed("tokenizer.ggml.model", "a string", G::as_str)?
        .unwrap_or("");
    ensure!(
        model == "gpt2",
        "tokenizer.ggml.model = {model:?}: only byte-level BPE tokenizers (\"gpt2\") are read; a SentencePiece vocabulary (\"llama\") needs its Hugging Face tokenizer.json"
    );
    let strings = |k: &str| -> Result<Vec<String>> {
        g.typed(k, "an array", G::as_array)?
            .with_context(|| format!("the file has no {k}"))?
            .iter()
            .map(|v| {
                v.as_str()
                    .map(String::from)
                    .with_context(|| format!("{k} holds a non-string"))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i128> = match g.typed("tokenizer.ggml.token_type", "an array", G::as_array)? {
        Some(a) => a
            .iter()
            .map(|v| {
                v.as_int().with_context(|| {
                    format!("tokenizer.ggml.token_type holds {}, not integers", v.kind())
                })
            })
            .collect::<Result<_>>()?,
        None => vec![1; tokens.len()],
    };
    ensure!(
        types.len() == tokens.len(),
        "tokenizer.ggml.token_type has {} entries for {} tokens",
        types.len(),
        tokens.len()
    );
    let mut vocab = Map::new();
    for (i, t) in tokens.iter().enumerate() {
        ensure!(
            vocab.insert(t.clone(), json!(i)).is_none(),
            "tokenizer.ggml.tokens holds {t:?} twice"
        );
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| {
            let (a, b) = m
                .split_once(' ')
                .with_context(|| format!("merge {m:?} is not two tokens"))?;
            Ok(json!([a, b]))
        })
        .collect::<Result<_>>()?;
    // Control tokens (type 3) are special; user-defined ones (4) are matched whole in text.
    let added: Vec<Value> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &ty))| ty == 3 || ty == 4)
        .map(|(i, (t, &ty))| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": ty == 3})
        })
        .collect();
    let pre_tokenizers = pre_tokenizers(g)?;
    let id_of = |k: &str| -> Result<Option<(usize, String)>> {
        match g.typed(k, "an integer", G::as_int)? {
            None => Ok(None),
            Some(i) => {
                let t = usize::try_from(i)
                    .ok()
                    .and_then(|i| tokens.get(i).map(|t| (i, t.clone())));
                t.map(Some)
                    .with_context(|| format!("{k} = {i} is not a token of the vocabulary"))
            }
        }
    };
    let bos = id_of("tokenizer.ggml.bos_token_id")?;
    let eos = id_of("tokenizer.ggml.eos_token_id")?;
    let add_bos = g
        .typed("tokenizer.ggml.add_bos_token", "a bool", G::as_bool)?
        .unwrap_or(false);
    let post = post_processor(&bos, add_bos)?;
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    });
    let mut tc = Map::new();
    tc.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    tc.insert("add_bos_token".into(), json!(add_bos));
    tc.insert("clean_up_tokenization_spaces".into(), json!(false));
    if let Some((_, t)) = &bos {
        tc.insert("bos_token".into(), json!(t));
    }
    if let Some((_, t)) = &eos {
        tc.insert("eos_token".into(), json!(t));
    }
    for (k, name) in [
        ("tokenizer.ggml.padding_token_id", "pad_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
    ] {
        if let Some((_, t)) = id_of(k)? {
            tc.insert(name.into(), json!(t));
        }
    }
    if let Some(t) = g.typed("tokenizer.chat_template", "a string", G::as_str)? {
        tc.insert("chat_template".into(), json!(t));
    }
    if let Some(n) = config.get("max_position_embeddings") {
        tc.insert("model_max_length".into(), n.clone());
    }
    // The tokenizer library itself must read what is written.
    tokenizers::Tokenizer::from_bytes(tokenizer.to_string().as_bytes()).map_err(|e| {
        anyhow::anyhow!("the tokenizer built from the file's metadata is not valid: {e}")
    })?;
    Ok((tokenizer, Value::Object(tc)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hugging_face_and_unknown_ones_pass_through() {
        assert_eq!(
            hf_name("token_embd.weight").unwrap(),
            "model.embed_tokens.weight"
        );
        assert_eq!(
            hf_name("blk.11.attn_q.bias").unwrap(),
            "model.layers.11.self_attn.q_proj.bias"
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").unwrap(),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(hf_name("blk.0.weird.weight").unwrap(), "blk.0.weird.weight");
        assert!(format!("{:#}", hf_name("rope_freqs.weight").unwrap_err()).contains("Llama 3.1"));
    }

    /// llama.cpp's permute (convert_hf_to_gguf.py: reshape to (heads, 2, dim / 2, ...),
    /// swap the middle axes) written out by hand for 2 heads of dimension 8, then undone.
    #[test]
    fn the_rotary_row_order_is_undone() {
        let hf: Vec<i64> = (0..16).collect();
        // Head h's rows [0 1 2 3 | 4 5 6 7] (two rotary halves) interleave in llama.cpp's
        // order: [0 4 1 5 2 6 3 7].
        let gguf = [0i64, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15];
        let t = Tensor::from_slice(&gguf).reshape([16, 1]);
        let back = unpermute(&t, 2).unwrap().reshape([16]);
        assert_eq!(Vec::<i64>::try_from(back).unwrap(), hf);
        assert!(unpermute(&t, 3).is_err());
    }
}
