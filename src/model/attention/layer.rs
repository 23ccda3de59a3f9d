//! The attention layer every model holds: the base projections (Hugging Face names), and the
//! method's part of the layer, built from its `MethodSpec`.

use super::base::{AttnOutput, Base, Build, Chunk, Projections, Route};
use super::cache::Keys;
use super::ctx::ForwardCtx;
use super::methods::spec;
use super::patterns::Keep;
use crate::config::{AttentionConfig, ModelConfig};
use crate::model::kernels::Kernels;
use crate::model::nn::Rope;
use tch::{nn, Tensor};

/// One attention layer of any method, with Hugging Face parameter names for the base
/// module; parameters a method adds sit beside them (`router`, `global_attn.*`, `swa_o_proj`).
pub(crate) struct SelfAttention {
    base: Base,
    route: Box<dyn Route>,
}

impl SelfAttention {
    /// `p` is `model.layers.N.self_attn`; `fixed_heads` this layer's fixed per-head assignment
    /// where the method reads one (`MethodSpec::fixed_heads`).
    pub(crate) fn new(
        p: nn::Path,
        layer: usize,
        m: &ModelConfig,
        a: &AttentionConfig,
        fixed_heads: Option<&[Option<usize>]>,
        kernels: Option<&'static Kernels>,
    ) -> Self {
        // The base projections first: parameters draw their initial values from tch's
        // generator in the order they are created.
        let proj = Projections::new(&p, m, kernels);
        let build = Build {
            p: &p,
            layer,
            m,
            a,
            fixed_heads,
            kernels,
        };
        let route = (spec(a.method).build)(&build);
        SelfAttention {
            base: Base {
                proj,
                window: a.window,
                layer,
                kernels,
            },
            route,
        }
    }

    /// Parameters a method adds that start as copies of base parameters, `(new, base)`:
    /// L2A's global module and SwiAttn's window-branch output projection.
    pub(crate) fn derived_params(&self) -> Vec<(String, String)> {
        let p = format!("model.layers.{}", self.base.layer);
        self.route
            .derived_params()
            .into_iter()
            .map(|(new, base)| (format!("{p}.{new}"), format!("{p}.{base}")))
            .collect()
    }

    /// Which keys each slot of this layer's decoding cache keeps (`Route::keeps`).
    pub(crate) fn keeps(&self) -> Vec<Keep> {
        self.route.keeps(&self.base)
    }

    /// Bytes of the key-value cache this layer needs for a context of `len` tokens at
    /// decode time (`elt` bytes per value): the positions each slot keeps (`Route::keeps`; a
    /// module of a method's own copies the base projections' shape).
    pub(crate) fn kv_cache_bytes(&self, len: usize, elt: usize) -> f64 {
        let per = self.base.proj.kv_bytes_per_position(elt);
        let keeps = self.route.keeps(&self.base);
        keeps.iter().map(|k| k.held(len) as f64 * per).sum()
    }

    /// `x: [B, T, hidden]` (already normalised in a pre-norm model), the chunk of positions
    /// `keys.start() ..`; `residual` the stream the block adds the output to, where that is
    /// not `x` (a pre-norm model's input before its norm); `rope` covers those positions.
    /// The method's file computes the rest.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        rope: &Rope,
        keys: &Keys,
        ctx: &ForwardCtx,
    ) -> AttnOutput {
        let kernels = self.base.kernels;
        let (q, k, v) = match self.base.proj.step(x, rope, keys, kernels) {
            Some(step) => step,
            None => {
                let (q, k, v) = self.base.proj.qkv(x, rope, kernels);
                let (k, v) = keys.extend(0, k, v);
                (q, k, v)
            }
        };
        let chunk = Chunk {
            x,
            residual: residual.unwrap_or(x),
            q: &q,
            k: &k,
            v: &v,
            rope,
            keys,
        };
        self.route.forward(&self.base, &chunk, ctx)
    }
}
