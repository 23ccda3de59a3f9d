//! The synthetic long-tail dependency corpus: events that define a key's value and ask for
//! it again a power-law distance later, in a filler language, with every position's
//! dependency distance recorded beside its token (`SynthSpec` holds the settings).

use super::meta::{prepare_out_dir, write_meta, Meta, SynthSpec, META_FORMAT};
use super::shards::{deps_name, write_shard_from, Width, DEPS_MAGIC, TOKENS_MAGIC};
use crate::util::rng::Rng;
use anyhow::Result;
use std::path::Path;

pub(crate) const DEF: u32 = 0;
pub(crate) const ASK: u32 = 1;

/// Dependency distance marking a position whose next token cannot be predicted from context
/// (the start of an event, a freshly drawn key or value).
pub(crate) const DEP_NONE: u32 = 0;

impl SynthSpec {
    fn first_value(&self) -> u32 {
        2 + self.n_keys as u32
    }
    fn first_filler(&self) -> u32 {
        self.first_value() + self.n_values as u32
    }

    /// Draws D from the truncated power law on [min_distance, max_distance] by inverting
    /// its continuous CDF and flooring.
    fn draw_distance(&self, rng: &mut Rng) -> usize {
        let (a, b, u) = (
            self.min_distance as f64,
            (self.max_distance + 1) as f64,
            rng.uniform(),
        );
        let x = if (self.alpha - 1.0).abs() < 1e-12 {
            a * (b / a).powf(u)
        } else {
            let e = 1.0 - self.alpha;
            (a.powf(e) + u * (b.powf(e) - a.powf(e))).powf(1.0 / e)
        };
        (x.floor() as usize).clamp(self.min_distance, self.max_distance)
    }
}

/// One generated stream: `deps[i]` is the dependency distance of the prediction made at
/// position i (of token i+1): 1 for filler (bigram), the distance back to the defining value
/// for the key of a query, `DEP_NONE` where the next token is unpredictable.
#[cfg(test)]
pub(crate) struct SynthStream {
    pub(crate) tokens: Vec<u32>,
    pub(crate) deps: Vec<u32>,
}

/// `n` tokens of `Tokens` collected (for the tests; `synth` streams them to disk).
#[cfg(test)]
pub(crate) fn synth_stream(spec: &SynthSpec, stream_seed: u64, n: usize) -> SynthStream {
    let (mut tokens, mut deps) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (i, (tok, dep)) in Tokens::new(spec, stream_seed, n).enumerate() {
        if i > 0 {
            deps.push(dep);
        }
        tokens.push(tok);
    }
    deps.push(DEP_NONE);
    SynthStream { tokens, deps }
}

/// The tokens of one stream, each with the dependency distance of its own prediction (made at
/// the position before it; `DEP_NONE` for the first), generated as they are read: memory does
/// not grow with the stream. The filler bigram table depends only on `spec.seed`, so train and
/// val (different `stream_seed`) share one language.
struct Tokens<'a> {
    spec: &'a SynthSpec,
    n: usize,
    successors: Vec<Vec<u32>>,
    zipf: Vec<f64>,
    n_filler: u32,
    rng: Rng,
    /// (position of the ASK marker, key, value, position of the defining value)
    pending: Vec<(usize, u32, u32, usize)>,
    key_busy: Vec<bool>,
    /// Tokens produced so far, and the last one.
    len: usize,
    prev: u32,
    /// Tokens of an event made and not yet read.
    queue: std::collections::VecDeque<(u32, u32)>,
}

impl<'a> Tokens<'a> {
    fn new(spec: &'a SynthSpec, stream_seed: u64, n: usize) -> Tokens<'a> {
        let mut table_rng = Rng::new(spec.seed);
        let n_filler = spec.vocab_size as u32 - spec.first_filler();
        let successors: Vec<Vec<u32>> = (0..spec.vocab_size)
            .map(|_| {
                (0..spec.branch)
                    .map(|_| spec.first_filler() + table_rng.below(n_filler as u64) as u32)
                    .collect()
            })
            .collect();
        let zipf: Vec<f64> = (0..spec.branch).map(|r| 1.0 / (r + 1) as f64).collect();
        Tokens {
            spec,
            n,
            successors,
            zipf,
            n_filler,
            rng: Rng::new(stream_seed),
            pending: Vec::new(),
            key_busy: vec![false; spec.n_keys],
            len: 0,
            prev: 0,
            queue: std::collections::VecDeque::new(),
        }
    }

    fn push(&mut self, tok: u32, dep: u32) {
        self.queue.push_back((tok, dep));
        self.len += 1;
        self.prev = tok;
    }

    fn filler(&mut self) {
        let next = self.successors[self.prev as usize][self.rng.weighted(&self.zipf)];
        self.push(next, 1);
    }

    /// The next token, or the next event's tokens (a query that fell due, a definition).
    fn step(&mut self) {
        let spec = self.spec;
        if self.len == 0 {
            let first = spec.first_filler() + self.rng.below(self.n_filler as u64) as u32;
            self.push(first, DEP_NONE);
            return;
        }
        let pos = self.len;
        let due = self
            .pending
            .iter()
            .enumerate()
            .filter(|(_, p)| p.0 <= pos)
            .min_by_key(|(_, p)| p.0)
            .map(|(i, _)| i);
        if let Some(i) = due {
            if pos + 3 > self.n {
                // Pad with filler: the query does not fit at the very end.
                self.pending.clear();
                return self.filler();
            }
            let (_, key, value, value_pos) = self.pending.swap_remove(i);
            self.push(ASK, DEP_NONE);
            self.push(2 + key, DEP_NONE);
            let key_pos = self.len - 1;
            self.push(value, (key_pos - value_pos) as u32);
            self.key_busy[key as usize] = false;
            return;
        }
        let free: Vec<u32> = (0..spec.n_keys as u32)
            .filter(|&k| !self.key_busy[k as usize])
            .collect();
        if !free.is_empty() && pos + 3 <= self.n && self.rng.uniform() < spec.event_rate {
            let key = free[self.rng.below(free.len() as u64) as usize];
            let value = spec.first_value() + self.rng.below(spec.n_values as u64) as u32;
            self.push(DEF, DEP_NONE);
            self.push(2 + key, DEP_NONE);
            self.push(value, DEP_NONE);
            let value_pos = self.len - 1;
            // The query's key sits D after the value, so its ASK marker sits at D - 1.
            let d = spec.draw_distance(&mut self.rng);
            self.pending
                .push((value_pos + d - 1, key, value, value_pos));
            self.key_busy[key as usize] = true;
            return;
        }
        self.filler();
    }
}

impl Iterator for Tokens<'_> {
    type Item = (u32, u32);

    fn next(&mut self) -> Option<(u32, u32)> {
        while self.queue.is_empty() && self.len < self.n {
            self.step();
        }
        self.queue.pop_front()
    }
}

/// Generates the synthetic corpus into `out`: one token shard and one dependency shard per
/// split, each streamed to disk as it is generated (the dependencies in a second pass of the
/// same generator), after the sizes are checked.
pub(crate) fn synth(spec: &SynthSpec, out: &Path) -> Result<Meta> {
    spec.validate()?;
    prepare_out_dir(out)?;
    let width = Width::for_vocab(spec.vocab_size);
    let mut names = Vec::new();
    for (split, n, salt) in [
        ("train", spec.train_tokens, 1u64),
        ("val", spec.val_tokens, 2u64),
    ] {
        let seed = spec.seed.wrapping_mul(0x9E37_79B9).wrapping_add(salt);
        let name = format!("{split}_000.bin");
        let tokens = Tokens::new(spec, seed, n).map(|(tok, _)| tok);
        write_shard_from(&out.join(&name), TOKENS_MAGIC, width, n, tokens)?;
        // The dependency of each position's prediction: that of the token after it.
        let deps = Tokens::new(spec, seed, n)
            .skip(1)
            .map(|(_, dep)| dep)
            .chain([DEP_NONE]);
        write_shard_from(&out.join(deps_name(&name)), DEPS_MAGIC, Width::U32, n, deps)?;
        names.push(name);
    }
    let meta = Meta {
        format: META_FORMAT,
        tokenizer: "synth".into(),
        vocab_size: spec.vocab_size,
        eot_token: None,
        train: vec![names[0].clone()],
        val: vec![names[1].clone()],
        train_tokens: spec.train_tokens as u64,
        val_tokens: spec.val_tokens as u64,
        synth: Some(spec.clone()),
        probes: None,
        corpus: None,
        shards_sha256: None,
    };
    write_meta(out, &meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synth_is_deterministic_and_deps_point_at_the_answer() {
        let spec = SynthSpec {
            train_tokens: 20_000,
            val_tokens: 1000,
            ..Default::default()
        };
        let a = synth_stream(&spec, 5, 20_000);
        let b = synth_stream(&spec, 5, 20_000);
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.deps, b.deps);
        assert_ne!(a.tokens, synth_stream(&spec, 6, 20_000).tokens);
        assert_eq!(a.tokens.len(), 20_000);
        assert_eq!(a.deps.len(), 20_000);
        let mut recalls = 0;
        for i in 0..a.tokens.len() - 1 {
            let d = a.deps[i] as usize;
            if d >= 2 {
                // Position i holds the queried key; i-d holds the defining value, preceded by
                // the same key and DEF; the token to predict is that value.
                recalls += 1;
                assert_eq!(a.tokens[i - 1], ASK);
                assert_eq!(a.tokens[i - d], a.tokens[i + 1]);
                assert_eq!(a.tokens[i - d - 1], a.tokens[i]);
                assert_eq!(a.tokens[i - d - 2], DEF);
                assert!(d >= spec.min_distance);
            }
        }
        assert!(recalls > 200, "only {recalls} recall events");
        // Long tail: fewer dependencies reach beyond larger windows.
        let beyond = |w: usize| a.deps.iter().filter(|&&d| d as usize >= w).count();
        assert!(beyond(4) > beyond(16) && beyond(16) > beyond(64) && beyond(64) > 0);
    }
}
