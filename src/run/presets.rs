//! The shapes of the pretrained models the papers study, by name: the fields of each one's
//! Hugging Face `config.json` that `[model]` reads, read by the same code as a converted
//! model's (`convert::model_from_hf`), so a preset is exactly the model it names (weights
//! aside).

use crate::config::ModelConfig;
use crate::run::convert::model_from_hf;
use anyhow::{Context, Result};
use std::path::Path;

/// (name, config.json) of each preset.
const PRESETS: &[(&str, &str)] = &[
    (
        "smollm2-135m",
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "vocab_size": 49152, "rope_theta": 100000,
            "rms_norm_eps": 1e-05, "tie_word_embeddings": true, "hidden_act": "silu",
            "initializer_range": 0.041666666666666664}"#,
    ),
    (
        "qwen3-0.6b",
        r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "rope_theta": 1000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": true,
            "hidden_act": "silu", "attention_bias": false}"#,
    ),
    (
        "qwen2.5-1.5b",
        r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
            "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
            "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": true, "hidden_act": "silu",
            "use_sliding_window": false}"#,
    ),
    (
        "olmo2-1b",
        r#"{"architectures": ["Olmo2ForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": 100352, "rope_theta": 500000,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": false, "hidden_act": "silu",
            "attention_bias": false}"#,
    ),
    (
        "llama3.2-1b",
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
            "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}, "rms_norm_eps": 1e-05, "tie_word_embeddings": true,
            "hidden_act": "silu", "attention_bias": false}"#,
    ),
];

/// The names of the presets.
pub(crate) fn names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.0).collect()
}

/// The model `spec` names: a preset, or a Hugging Face `config.json` (its path, or the
/// directory holding it), validated.
pub(crate) fn model(spec: &str) -> Result<ModelConfig> {
    let (text, from) = match PRESETS.iter().find(|p| p.0 == spec) {
        Some((_, json)) => (json.to_string(), format!("preset {spec}")),
        None => {
            let p = Path::new(spec);
            let file = if p.is_dir() {
                p.join("config.json")
            } else {
                p.to_path_buf()
            };
            let text = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "{spec:?} is neither a preset ({}) nor a readable config.json",
                    names().join(", ")
                )
            })?;
            (text, file.display().to_string())
        }
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{from} is not JSON"))?;
    let (_, m, _) = model_from_hf(&value).with_context(|| format!("in {from}"))?;
    m.validate().with_context(|| format!("in {from}"))?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{NormPlacement, QkNorm};

    /// Every preset reads; the ones the targets name have the shapes of their models
    /// (GQA, untied head, the family's norms).
    #[test]
    fn presets_are_the_models_they_name() {
        for name in names() {
            model(name).unwrap();
        }
        let q = model("qwen2.5-1.5b").unwrap();
        assert_eq!(
            (
                q.hidden_size,
                q.num_attention_heads,
                q.num_key_value_heads,
                q.head_dim()
            ),
            (1536, 12, 2, 128)
        );
        assert!(q.attention_bias && q.tie_word_embeddings);
        let o = model("olmo2-1b").unwrap();
        assert_eq!(
            (o.qk_norm, o.norm_placement),
            (QkNorm::Full, NormPlacement::Post)
        );
        assert!(!o.tie_word_embeddings);
        assert_eq!(model("qwen3-0.6b").unwrap().qk_norm, QkNorm::PerHead);
        let s = model("smollm2-135m").unwrap();
        assert_eq!(
            (s.num_hidden_layers, s.head_dim(), s.vocab_size),
            (30, 64, 49152)
        );
        let e = format!("{:#}", model("no-such-model").unwrap_err());
        assert!(
            e.contains("neither a preset") && e.contains("olmo2-1b"),
            "{e}"
        );
    }
}
