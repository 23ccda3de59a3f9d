//! `[model]`: the architecture, with Hugging Face's names so a converted model's
//! configuration carries over unchanged.

use super::check::{check, check_open_f};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Field names follow the Hugging Face `config.json` of Llama-family models so a converted
/// model's configuration carries over unchanged.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// 0 means "take it from the prepared data set"; the resolved config holds the real value.
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// 0 means hidden_size / num_attention_heads.
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub initializer_range: f64,
    /// RMSNorm of queries and keys: none (Llama, Qwen2), per head over head_dim before RoPE
    /// (Qwen3), or over the whole projection (OLMo-2).
    pub qk_norm: QkNorm,
    /// pre: norm before attention and MLP (Llama); post: norm on their outputs before the
    /// residual add (OLMo-2).
    pub norm_placement: NormPlacement,
    /// Hugging Face's rope_scaling: None, linear or llama3.
    pub rope_scaling: Option<RopeScaling>,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    PerHead,
    Full,
}

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    Pre,
    Post,
}

/// Rotary frequency scaling as Hugging Face configs write it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// "linear" or "llama3".
    pub rope_type: String,
    pub factor: f64,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<f64>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            vocab_size: 0,
            hidden_size: 128,
            intermediate_size: 384,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 4,
            head_dim: 0,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-5,
            attention_bias: false,
            tie_word_embeddings: true,
            initializer_range: 0.02,
            qk_norm: QkNorm::None,
            norm_placement: NormPlacement::Pre,
            rope_scaling: None,
        }
    }
}

impl ModelConfig {
    pub(crate) fn head_dim(&self) -> usize {
        if self.head_dim == 0 {
            self.hidden_size / self.num_attention_heads.max(1)
        } else {
            self.head_dim
        }
    }
}

impl ModelConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        let m = self;
        if m.vocab_size != 0 {
            check("model.vocab_size", m.vocab_size, 2, 1 << 24)?;
        }
        check("model.hidden_size", m.hidden_size, 1, 65_536)?;
        check("model.intermediate_size", m.intermediate_size, 1, 1 << 18)?;
        check("model.num_hidden_layers", m.num_hidden_layers, 1, 1024)?;
        check("model.num_attention_heads", m.num_attention_heads, 1, 1024)?;
        check(
            "model.num_key_value_heads",
            m.num_key_value_heads,
            1,
            m.num_attention_heads,
        )?;
        if m.num_attention_heads % m.num_key_value_heads != 0 {
            bail!(
                "model.num_key_value_heads = {} must divide model.num_attention_heads = {}",
                m.num_key_value_heads,
                m.num_attention_heads
            );
        }
        if m.head_dim == 0 && m.hidden_size % m.num_attention_heads != 0 {
            bail!(
                "model.hidden_size = {} is not divisible by model.num_attention_heads = {}; set model.head_dim",
                m.hidden_size,
                m.num_attention_heads
            );
        }
        check("model.head_dim", m.head_dim(), 2, 1024)?;
        if m.head_dim() % 2 != 0 {
            bail!(
                "model.head_dim = {} must be even (rotary embedding rotates pairs)",
                m.head_dim()
            );
        }
        // Below 1 the rotary frequencies theta^(-2i/d) exceed one turn per token and overflow
        // for tiny bases (1e-300 gives infinities).
        check("model.rope_theta", m.rope_theta, 1.0, 1e12)?;
        check_open_f("model.rms_norm_eps", m.rms_norm_eps, 0.0, 1.0)?;
        check_open_f("model.initializer_range", m.initializer_range, 0.0, 10.0)?;
        if let Some(r) = &m.rope_scaling {
            check_open_f("model.rope_scaling.factor", r.factor, 0.0, 1e6)?;
            match r.rope_type.as_str() {
                "linear" => {}
                "llama3" => {
                    let (Some(lo), Some(hi), Some(orig)) = (
                        r.low_freq_factor,
                        r.high_freq_factor,
                        r.original_max_position_embeddings,
                    ) else {
                        bail!("model.rope_scaling of type llama3 needs low_freq_factor, high_freq_factor and original_max_position_embeddings");
                    };
                    if !(lo > 0.0 && hi > lo && orig > 0.0 && hi.is_finite() && orig.is_finite()) {
                        bail!("model.rope_scaling: need 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0");
                    }
                }
                t => {
                    bail!("model.rope_scaling.rope_type = {t:?} is not supported (linear, llama3)")
                }
            }
        }
        Ok(())
    }
}
