//! What one forward pass is asked for beyond the model's own parameters: gate overrides, the
//! seed of context-free gates, L2A's forced global step, the logits' dtype and timing.

use tch::Tensor;

/// Per-forward options that are not part of the model.
#[derive(Default)]
pub struct ForwardCtx {
    /// L2A: run global attention for every token this step (p_force).
    pub(crate) force_global: bool,
    pub(crate) gate_override: Option<GateOverride>,
    /// The share of each router penalty's `attention.lambda` this step (`train.lambda_ramp`);
    /// None carries all of it.
    pub(crate) penalty_scale: Option<f64>,
    /// Static heads ramped along a run's usage (`attention.top_k_ramp`): how many of the
    /// ranked full heads run full in this step; None: all of them.
    pub(crate) static_heads: Option<usize>,
    /// Seed of drawn gates (Bernoulli gates, the sampled straight-through gradient's probes):
    /// each draw is a hash of (seed, layer, batch row, position, head), so a token's gate does
    /// not depend on how the sequence is cut into chunks.
    pub(crate) gate_seed: u64,
    /// The step's row that this pass's first row is (a training pass of micro-batch j starts
    /// at row j x batch_size): rows are counted over the step, so a pass joining micro-batches,
    /// or a rank's share of them, draws for each sequence what separate passes draw.
    pub(crate) gate_row: i64,
    /// Leave the logits in the compute dtype (training's fused loss reads them so) instead
    /// of fp32.
    pub(crate) compute_logits: bool,
    /// When Some, each attention layer's forward is timed, the device synchronised before
    /// and after it, and its seconds added here: the attention layers' share of a forward.
    /// The synchronisation slows the forward, so a forward's own time is taken without it.
    pub(crate) attention_seconds: std::cell::Cell<Option<f64>>,
}

impl ForwardCtx {
    /// The share of `attention.lambda` the routers' penalty carries in this forward.
    pub(crate) fn penalty_scale(&self) -> f64 {
        self.penalty_scale.unwrap_or(1.0)
    }
}

/// Replaces the gates a layer would compute, for analysis and tests.
pub(crate) enum GateOverride {
    /// Every gate of every layer is this value (0 or 1); the STE gradient still flows.
    Constant(f64),
    /// Every gate of every layer open exactly at the positions `open` marks (`[B, T]`, 1
    /// open; position t of the sequence, however it is chunked) and at every position past
    /// `T` (what is generated after a prompt): an oracle's gates.
    Positions(Tensor),
    /// Per layer `(hard, anchor)`: the gate is `hard + s - anchor`, the soft relaxation around
    /// recorded hard gates, whose gradient at `s = anchor` is exactly the STE gradient (the
    /// tests' check of the router's gradient).
    #[cfg(test)]
    Relaxed(Vec<(Tensor, Tensor)>),
}
