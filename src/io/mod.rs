//! Files of tensors: checkpoints written and read back, PyTorch archives read without Python.

pub mod checkpoint;
pub(crate) mod gguf;
pub(crate) mod pickle;
mod unpickle;
