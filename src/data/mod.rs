//! Token data: binary shards on disk, the byte-level tokenizer, the synthetic long-tail
//! dependency corpus, and the loader that samples training windows from memory-mapped shards.
//!
//! Shard layout (llm.c's): a header of 256 little-endian int32 (`[0]` magic, `[1]` version,
//! `[2]` number of values), then the values. Token shards use magic 20240520 with version 1
//! for uint16 and version 2 for uint32 tokens. The synthetic corpus stores each position's
//! dependency distance in a parallel uint32 shard with magic 20261122. A data set is a
//! directory with `meta.json` (written last: without it the directory is not a data set)
//! and its shards.

pub(crate) mod corpus;
pub(crate) mod meta;
pub(crate) mod probes;
pub(crate) mod shards;
pub(crate) mod synth;
pub(crate) mod tokenizer;

pub(crate) use meta::identity;
pub(crate) use meta::SynthSpec;
pub use meta::{read_meta, Meta};
pub(crate) use shards::Split;
pub use shards::{write_shard, Shard, Width, TOKENS_MAGIC};
pub(crate) use synth::{synth, DEP_NONE};
#[cfg(test)]
pub(crate) use tokenizer::BYTE_EOT;
pub(crate) use tokenizer::{tokenizer_of, TextTokenizer};
