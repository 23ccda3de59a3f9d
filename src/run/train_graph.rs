//! `train.cuda_graph`: a run's step captured as a CUDA graph and replayed (`StepGraph`).
//!
//! A step runs eagerly first (its gradients, the sequence's pinned masks and the libraries'
//! handles come into being). A step whose forward takes the constants (`CtxKey`) of the step
//! before it, or of the graph last captured, is captured and replayed, and every later step
//! with those constants replays it. A step under others (L2A's forced global step, the
//! routers' hold) drops the graph first, so its eager activations never sit beside the graph's
//! pool (the memory plan counts one step's), and the next step with the graph's constants
//! captures it again. So does the step after an evaluation, which the graph's memory is given
//! to. A capture that fails is reported once and the run goes on eagerly.

use crate::config::Config;
use crate::model::attention::ForwardCtx;
use crate::model::kernels::Kernels;
use crate::model::step::{forward_backward, MicroStep, StepPlan};
use crate::model::step_graph::{CtxKey, StepGraph};
use crate::model::Llama;
use crate::run::optim::AdamW;
use anyhow::{bail, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use tch::{Device, Tensor};

/// Steps this process ran by replaying a captured graph (a process trains one run).
static REPLAYED: AtomicUsize = AtomicUsize::new(0);

/// Steps this process ran by replaying a captured graph.
pub(crate) fn replayed() -> usize {
    REPLAYED.load(Ordering::Relaxed)
}

pub(crate) struct Graphs {
    kern: &'static Kernels,
    draws: bool,
    /// The trained parameters, whose gradients the graph zeroes and adds into.
    trained: Vec<Tensor>,
    /// The constants of the step before, and of the graph last captured.
    last: Option<CtxKey>,
    captured: Option<CtxKey>,
    graph: Option<StepGraph>,
    /// Set once a capture failed: every later step runs eagerly.
    failed: bool,
}

impl Graphs {
    /// What `train.cuda_graph` asks of a run of `cfg` on `device` (None where it is off):
    /// `passes` forward and backward passes a step, in a data-parallel job or not. An error
    /// names what stops the capture and the setting that lifts it.
    pub(crate) fn new(
        cfg: &Config,
        model: &Llama,
        trained: &[Tensor],
        passes: usize,
        ranked: bool,
        device: Device,
    ) -> Result<Option<Graphs>> {
        if !cfg.train.cuda_graph {
            return Ok(None);
        }
        if ranked {
            bail!(
                "train.cuda_graph captures one process's step, and a data-parallel rank's step \
                 waits on the other ranks' gradients: train this run without it"
            );
        }
        if passes != 1 {
            bail!(
                "train.cuda_graph captures a step of one forward and backward pass, and this \
                 run's step takes {passes}: set train.micro_batch = train.batch_size x \
                 train.grad_accum (`sweep --join-micro-batches`), or train.grad_accum = 1"
            );
        }
        let (Device::Cuda(_), Some(kern)) = (device, model.kernels) else {
            bail!(
                "train.cuda_graph captures the step the kernel library runs on a CUDA GPU, and \
                 this run has no GPU or no library (attnsweep kernels build): set \
                 train.cuda_graph = false"
            );
        };
        model.pin_sequence(cfg.data.seq_len as i64, device);
        Ok(Some(Graphs {
            kern,
            draws: cfg.attention.draws_gates(),
            trained: trained.iter().map(Tensor::shallow_clone).collect(),
            last: None,
            captured: None,
            graph: None,
            failed: false,
        }))
    }

    /// The step's one pass on `x -> y`, gradients from zero: replayed where the graph holds
    /// `ctx`'s constants, captured and replayed where the step before or the graph last
    /// captured had them, else eagerly (`opt` zeroes the gradients first).
    pub(crate) fn pass(
        &mut self,
        model: &Llama,
        x: &Tensor,
        y: &Tensor,
        ctx: &ForwardCtx,
        plan: &StepPlan,
        opt: &AdamW,
    ) -> Result<MicroStep> {
        let key = CtxKey::of(ctx, self.draws).filter(|_| !self.failed);
        let last = std::mem::replace(&mut self.last, key.clone());
        if let Some(k) = &key {
            if let Some(g) = self.graph.as_ref().filter(|g| g.fits(x, k)) {
                REPLAYED.fetch_add(1, Ordering::Relaxed);
                return g.run(x, y, k);
            }
        }
        // Whatever runs now, the graph's pool goes first.
        self.graph = None;
        let seen = |k: &CtxKey| last.as_ref() == Some(k) || self.captured.as_ref() == Some(k);
        if let Some(k) = key.as_ref().filter(|k| seen(k)) {
            let captured = catch_unwind(AssertUnwindSafe(|| {
                StepGraph::capture(self.kern, model, &self.trained, x, y, ctx, k.clone(), plan)
            }));
            match captured {
                Ok(Ok(g)) => {
                    let m = g.run(x, y, k)?;
                    REPLAYED.fetch_add(1, Ordering::Relaxed);
                    (self.graph, self.captured) = (Some(g), Some(k.clone()));
                    return Ok(m);
                }
                Ok(Err(e)) => eprintln!("warning: {e:#}; the run goes on without a CUDA graph"),
                Err(_) => eprintln!(
                    "warning: capturing the step as a CUDA graph failed (above); the run goes \
                     on without one"
                ),
            }
            self.failed = true;
        }
        opt.zero_grad();
        Ok(forward_backward(model, x, y, ctx, plan, 1).read())
    }

    /// Drops the graph, its memory free for an evaluation; the next step captures it again.
    pub(crate) fn release(&mut self) {
        self.graph = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Method, Router};
    use crate::run::Built;

    /// Each condition a captured step needs is refused with the setting that lifts it: a
    /// run without a CUDA GPU, a data-parallel rank, several passes a step (by the trainer),
    /// and gates drawn afresh each step or a forward changed every step (by the config).
    #[test]
    fn what_a_captured_step_needs_is_named() {
        let mut c = Config::default();
        c.model.num_hidden_layers = 1;
        (
            c.model.hidden_size,
            c.model.intermediate_size,
            c.model.vocab_size,
        ) = (128, 24, 64);
        (c.model.num_attention_heads, c.model.num_key_value_heads) = (2, 2);
        c.train.device = "cpu".into();
        let b = Built::new(&c, Device::Cpu).unwrap();
        let trained: Vec<Tensor> = b.params().into_values().collect();
        let new = |c: &Config, passes, ranked| {
            Graphs::new(c, &b.model, &trained, passes, ranked, Device::Cpu)
        };
        assert!(new(&c, 2, true).unwrap().is_none(), "off by default");
        c.train.cuda_graph = true;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("takes train.dtype = \"bf16\""), "{e}");
        c.train.dtype = crate::config::Dtype::Bf16;
        c.validate().unwrap();
        let e = format!("{:#}", new(&c, 1, true).err().unwrap());
        assert!(e.contains("a data-parallel rank's step"), "{e}");
        let e = format!("{:#}", new(&c, 2, false).err().unwrap());
        assert!(e.contains("this run's step takes 2"), "{e}");
        let e = format!("{:#}", new(&c, 1, false).err().unwrap());
        assert!(e.contains("no GPU or no library"), "{e}");
        c.attention.method = Method::Aha;
        c.attention.router = Router::Bernoulli;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("drawn afresh each step"), "{e}");
        c.attention.router = Router::Learned;
        c.train.lambda_ramp = true;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("train.lambda_ramp"), "{e}");
    }
}
