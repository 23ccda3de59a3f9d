//! Data sets on disk: a directory of shards and, written last, `meta.json` (`meta.rs`: without
//! it the directory is not a data set); the shards and the loader that samples training
//! windows from them (`shards.rs`); how text becomes tokens (`tokenizer.rs`); the synthetic
//! long-tail dependency corpus (`synth.rs`); text corpora read from files (`corpus.rs`,
//! `data prepare`, in the formats of `formats.rs`); and RULER-style probe documents (`probes.rs`, `data probes`).

pub(crate) mod corpus;
mod formats;
pub(crate) mod meta;
pub(crate) mod needles;
pub(crate) mod probes;
pub(crate) mod ruler;
pub(crate) mod shards;
pub(crate) mod synth;
pub(crate) mod tokenizer;

pub(crate) use meta::SynthSpec;
pub(crate) use meta::{check_shards, identity};
pub use meta::{read_meta, Meta};
pub(crate) use shards::Split;
pub use shards::{write_shard, Shard, Width, TOKENS_MAGIC};
pub(crate) use synth::{synth, DEP_NONE};
#[cfg(test)]
pub(crate) use tokenizer::BYTE_EOT;
pub(crate) use tokenizer::{tokenizer_of, TextTokenizer};
