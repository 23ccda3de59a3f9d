//! The synthetic long-tail dependency corpus: events that define a key's value and ask for
//! it again a power-law distance later, in a filler language, with every position's
//! dependency distance recorded beside its token (`SynthSpec` holds the settings).

use super::meta::{prepare_out_dir, write_meta, Meta, SynthSpec, META_FORMAT};
use super::shards::{deps_name, write_shard, Width, DEPS_MAGIC, TOKENS_MAGIC};
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
pub(crate) struct SynthStream {
    pub(crate) tokens: Vec<u32>,
    pub(crate) deps: Vec<u32>,
}

/// Generates `n` tokens. The filler bigram table depends only on `spec.seed`, so train and
/// val (different `stream_seed`) share one language.
pub(crate) fn synth_stream(spec: &SynthSpec, stream_seed: u64, n: usize) -> SynthStream {
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

    let mut rng = Rng::new(stream_seed);
    let mut tokens: Vec<u32> = Vec::with_capacity(n);
    let mut deps: Vec<u32> = Vec::with_capacity(n);
    // Records the dependency of the prediction of `tok` (made at the previous position).
    let push = |tokens: &mut Vec<u32>, deps: &mut Vec<u32>, tok: u32, dep: u32| {
        if !tokens.is_empty() {
            deps.push(dep);
        }
        tokens.push(tok);
    };
    // (position of the ASK marker, key, value, position of the defining value)
    let mut pending: Vec<(usize, u32, u32, usize)> = Vec::new();
    let mut key_busy = vec![false; spec.n_keys];
    push(
        &mut tokens,
        &mut deps,
        spec.first_filler() + rng.below(n_filler as u64) as u32,
        DEP_NONE,
    );
    while tokens.len() < n {
        let pos = tokens.len();
        let due = pending
            .iter()
            .enumerate()
            .filter(|(_, p)| p.0 <= pos)
            .min_by_key(|(_, p)| p.0)
            .map(|(i, _)| i);
        if let Some(i) = due {
            if pos + 3 > n {
                break;
            }
            let (_, key, value, value_pos) = pending.swap_remove(i);
            push(&mut tokens, &mut deps, ASK, DEP_NONE);
            push(&mut tokens, &mut deps, 2 + key, DEP_NONE);
            let key_pos = tokens.len() - 1;
            push(&mut tokens, &mut deps, value, (key_pos - value_pos) as u32);
            key_busy[key as usize] = false;
            continue;
        }
        let free: Vec<u32> = (0..spec.n_keys as u32)
            .filter(|&k| !key_busy[k as usize])
            .collect();
        if !free.is_empty() && pos + 3 <= n && rng.uniform() < spec.event_rate {
            let key = free[rng.below(free.len() as u64) as usize];
            let value = spec.first_value() + rng.below(spec.n_values as u64) as u32;
            push(&mut tokens, &mut deps, DEF, DEP_NONE);
            push(&mut tokens, &mut deps, 2 + key, DEP_NONE);
            push(&mut tokens, &mut deps, value, DEP_NONE);
            let value_pos = tokens.len() - 1;
            // The query's key sits D after the value, so its ASK marker sits at D - 1.
            let d = spec.draw_distance(&mut rng);
            pending.push((value_pos + d - 1, key, value, value_pos));
            key_busy[key as usize] = true;
            continue;
        }
        let prev = *tokens.last().unwrap() as usize;
        let next = successors[prev][rng.weighted(&zipf)];
        push(&mut tokens, &mut deps, next, 1);
    }
    // Pad with filler if an event did not fit at the very end.
    while tokens.len() < n {
        let prev = *tokens.last().unwrap() as usize;
        push(
            &mut tokens,
            &mut deps,
            successors[prev][rng.weighted(&zipf)],
            1,
        );
    }
    deps.push(DEP_NONE);
    SynthStream { tokens, deps }
}

/// Writes the synthetic corpus (tokens and dependency shards) as a data set.
pub(crate) fn synth(spec: &SynthSpec, out: &Path) -> Result<Meta> {
    spec.validate()?;
    prepare_out_dir(out)?;
    let width = Width::for_vocab(spec.vocab_size);
    let mut names = Vec::new();
    for (split, n, salt) in [
        ("train", spec.train_tokens, 1u64),
        ("val", spec.val_tokens, 2u64),
    ] {
        let s = synth_stream(
            spec,
            spec.seed.wrapping_mul(0x9E37_79B9).wrapping_add(salt),
            n,
        );
        let name = format!("{split}_000.bin");
        write_shard(&out.join(&name), TOKENS_MAGIC, width, &s.tokens)?;
        write_shard(&out.join(deps_name(&name)), DEPS_MAGIC, Width::U32, &s.deps)?;
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
