//! The method variants the benches time (`MethodSpec::bench`), the model each runs as, and
//! the routers set to open at the bench's usage: what `bench train` and `bench decode` share.

use crate::config::{AttnImpl, Config, Dtype, Method, ModelConfig};
use crate::model::attention::{all_methods, BenchKnobs, BenchVariant, ForwardCtx};
use crate::run::Built;
use tch::{Device, Kind, Tensor};

/// One method variant the benches time (`MethodSpec::bench`): `aha`, `aha-sampled`, ...
#[derive(Clone, Copy)]
pub(crate) struct TrainMethod {
    pub(crate) method: Method,
    pub(crate) variant: &'static BenchVariant,
}

impl TrainMethod {
    /// Every variant the registry lists, in its order.
    pub(crate) fn all() -> impl Iterator<Item = TrainMethod> {
        all_methods().flat_map(|s| {
            s.bench.iter().map(|variant| TrainMethod {
                method: s.method,
                variant,
            })
        })
    }

    /// The variant named `name` (for `--methods`).
    pub(crate) fn parse(name: &str) -> std::result::Result<TrainMethod, String> {
        TrainMethod::all()
            .find(|m| m.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = TrainMethod::all().map(|m| m.name()).collect();
                format!(
                    "{name:?} is not a method the bench times ({})",
                    names.join(", ")
                )
            })
    }

    pub(crate) fn name(self) -> &'static str {
        self.variant.name
    }
}

/// A bench's model with `method`'s variant on the kernels in bf16 on the GPU: its set-up at
/// the gates' usage and straight-through sample of `knobs`, with `window` and PPA's `power`.
pub(crate) fn method_config(
    model: &ModelConfig,
    method: TrainMethod,
    knobs: &BenchKnobs,
    window: usize,
    power: f64,
) -> Config {
    let mut c = Config::default();
    c.model = model.clone();
    c.attention.method = method.method;
    (method.variant.setup)(&mut c.attention, knobs);
    c.attention.ppa_power = power;
    c.attention.window = window;
    c.attention.attn_impl = AttnImpl::Cuda;
    c.train.dtype = Dtype::Bf16;
    c.train.device = "cuda".into();
    c
}

/// Sets every router so that about `usage` of its gates (AHA: per token and head; SwiAttn:
/// per token) open on random tokens: random weights (unit-variance logits on normalised
/// inputs), then, layer by layer under the gates of the layers below, the bias that puts the
/// threshold at the `1 - usage` quantile of the measured logits.
pub(crate) fn calibrate_routers(built: &Built, usage: f64, len: i64) {
    let params = built.params();
    let dev = Device::Cuda(0);
    tch::no_grad(|| {
        for (name, p) in &params {
            if name.ends_with("router.weight") {
                let d = p.size()[1] as f64;
                p.shallow_clone().copy_(&(p.randn_like() / d.sqrt()));
            } else if name.ends_with("router.bias") {
                let _ = p.shallow_clone().zero_();
            }
        }
        // The calibration's forwards keep no graph; a shorter sequence suffices for the
        // quantile and keeps the logits small.
        let len = len.min(8192);
        let ids = Tensor::randint(
            built.model.cfg.vocab_size as i64,
            [1, len],
            (Kind::Int64, dev),
        );
        for layer in 0..built.model.layers.len() {
            let out = built.model.forward(&ids, &ForwardCtx::default());
            let s = out.layers[layer]
                .scores
                .as_ref()
                .expect("layers with learned routers have router scores");
            let bias = &params[&format!("model.layers.{layer}.self_attn.router.bias")];
            // Logits with the current (zero) bias of this layer.
            let logits = (s / (s.ones_like() - s)).log().flatten(0, -1);
            let q = logits.quantile_scalar(1.0 - usage, None, false, "linear");
            let _ = bias.shallow_clone().fill_(-q.double_value(&[]));
        }
    });
}
