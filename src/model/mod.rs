//! The model layer: the CUDA kernel library and its typed calls (`kernels/`), the layers every
//! model shares (`nn.rs`), attention with one file per method (`attention/`), and the decoder
//! that stacks them (`llama.rs`).

pub mod attention;
pub(crate) mod kernels;
pub(crate) mod llama;
pub(crate) mod nn;

pub use llama::*;
