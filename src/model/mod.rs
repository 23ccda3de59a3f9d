//! The model layer: the CUDA kernel library and its typed calls (`kernels/`), the layers every
//! model shares (`nn.rs`), attention with one file per method (`attention/`), the decoder
//! that stacks them (`llama.rs`), and a training micro-step's forward and backward with
//! activation checkpointing and a chunked loss (`step.rs`).

pub mod attention;
pub(crate) mod kernels;
pub(crate) mod llama;
pub(crate) mod nn;
pub(crate) mod step;
pub(crate) mod step_graph;

pub use llama::*;
