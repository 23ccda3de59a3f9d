//! Where a layer's keys and values come from in one forward: the chunk being processed alone
//! (training, whole-sequence evaluation), or a decoding cache the chunk extends, which keeps
//! what later tokens may read (`Keep`, as the method states it: a window layer only its
//! window).

use super::patterns::{Keep, KeyPattern, MaskCache};
use std::cell::RefCell;
use tch::{Kind, Tensor};

/// One stream of cached keys and values with their absolute positions.
struct Slot {
    k: Tensor,
    v: Tensor,
    pos: Tensor,
}

/// A layer's decoding cache: slot 0 holds the attention's keys and values, slot 1 those of
/// L2A's global module. Layers that only ever look back a window keep only that window.
#[derive(Default)]
pub(crate) struct LayerCache {
    slots: [Option<Slot>; 2],
}

impl LayerCache {
    /// Bytes held (keys and values).
    pub(crate) fn bytes(&self) -> f64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| (s.k.numel() + s.v.numel()) as f64 * s.k.kind().elt_size_in_bytes() as f64)
            .sum()
    }
}

/// Where a layer's keys and values come from: the chunk being processed alone (training,
/// whole-sequence evaluation), or a decoding cache the chunk's keys extend.
pub(crate) enum Keys<'a> {
    Chunk(&'a MaskCache),
    Cache {
        cache: &'a RefCell<LayerCache>,
        start: i64,
    },
}

impl Keys<'_> {
    /// Position of the chunk's first token.
    pub(super) fn start(&self) -> i64 {
        match self {
            Keys::Chunk(_) => 0,
            Keys::Cache { start, .. } => *start,
        }
    }

    /// The keys and values to attend over: the chunk's, after the cached ones of `slot`.
    pub(super) fn extend(&self, slot: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let Keys::Cache { cache, start } = self else {
            return (k, v);
        };
        let mut c = cache.borrow_mut();
        let n = k.size()[2];
        let pos = Tensor::arange_start(*start, start + n, (Kind::Int64, k.device()));
        let merged = match c.slots[slot].take() {
            Some(s) => Slot {
                k: Tensor::cat(&[&s.k, &k], 2),
                v: Tensor::cat(&[&s.v, &v], 2),
                pos: Tensor::cat(&[&s.pos, &pos], 0),
            },
            None => Slot { k, v, pos },
        };
        let out = (merged.k.shallow_clone(), merged.v.shallow_clone());
        c.slots[slot] = Some(merged);
        out
    }

    /// Whether `slot` holds this chunk's `n` keys alone, from position 0: a prefill into an
    /// empty cache, which attends as a forward over the chunk does.
    pub(super) fn prefill_only(&self, slot: usize, n: i64) -> bool {
        match self {
            Keys::Chunk(_) => false,
            Keys::Cache { cache, start } => {
                *start == 0
                    && cache.borrow().slots[slot]
                        .as_ref()
                        .is_some_and(|s| s.pos.size()[0] == n)
            }
        }
    }

    /// `pattern` for queries of this chunk over keys from `extend(slot, ..)`.
    pub(super) fn attend(
        &self,
        slot: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        pattern: KeyPattern,
    ) -> Tensor {
        match self {
            Keys::Chunk(masks) => masks.attend(q, k, v, pattern),
            Keys::Cache { cache, start } => {
                let c = cache.borrow();
                let kpos = &c.slots[slot]
                    .as_ref()
                    .expect("extended before attending")
                    .pos;
                let n = q.size()[2];
                let gqa = q.size()[1] != k.size()[1];
                let sdpa = |k: &Tensor, v: &Tensor, mask: Option<&Tensor>, causal: bool| {
                    Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, None, gqa)
                };
                // Where every earlier key is seen, no mask is built: a prefill into an empty
                // cache is the causal square (the fused kernels take it), and one decoded
                // query sees every cached key. A dense mask of a 32K prefill alone is 1 GiB.
                if pattern.is_full_at((start + n) as usize) {
                    if kpos.size()[0] == n {
                        return sdpa(k, v, None, true);
                    }
                    if n == 1 {
                        return sdpa(k, v, None, false);
                    }
                }
                // One decoded query through a window sees the last w keys: a slot holds
                // consecutive positions ending at the query's own (chunks are appended in
                // order and `trim` keeps a suffix), so they are a narrow, and no mask is built.
                if let (Keep::Ends { first: 0, last }, 1) = (pattern.keeps(), n) {
                    return sdpa(&last_keys(k, 2, last), &last_keys(v, 2, last), None, false);
                }
                let qpos = Tensor::arange_start(*start, start + n, (Kind::Int64, q.device()));
                let seen = pattern.seen(&qpos, kpos, (start + n) as usize);
                sdpa(k, v, Some(&seen), false)
            }
        }
    }

    /// Drops the cached keys of `slot` that `keep` does not keep.
    pub(super) fn trim(&self, slot: usize, keep: Keep) {
        let (Keys::Cache { cache, .. }, Keep::Ends { first, last }) = (self, keep) else {
            return;
        };
        let mut c = cache.borrow_mut();
        let Some(s) = c.slots[slot].as_mut() else {
            return;
        };
        // The first keys, then the last `last`, the window of the last query: a rolling
        // buffer at its peak size (the next query needs last - 1 of them beside its own). The
        // slot holds its first keys, then consecutive positions up to the chunk's last, so
        // they are its ends: narrows, with no search of the positions (and no wait for the
        // device to answer one).
        let len = s.pos.size()[0];
        if len <= (first + last) as i64 {
            return;
        }
        // A view keeps the whole tensor alive: after a prefill longer than the ends the kept
        // keys are copied out, so the rest is freed; a decoding step drops one key, and its
        // view is replaced by the next step's concatenation anyway.
        let copy = 2 * ((first + last) as i64) < len;
        let ends = |t: &Tensor, dim: i64| {
            let tail = last_keys(t, dim, last);
            let kept = match first {
                0 => tail,
                _ => Tensor::cat(&[&t.narrow(dim, 0, first as i64), &tail], dim),
            };
            if copy {
                kept.contiguous()
            } else {
                kept
            }
        };
        s.k = ends(&s.k, 2);
        s.v = ends(&s.v, 2);
        s.pos = ends(&s.pos, 0);
    }
}

/// The last `w` entries of `t` along `dim` (all of them when it holds fewer), as a view: a
/// slot's keys are consecutive positions, so a window's keys are its suffix.
fn last_keys(t: &Tensor, dim: i64, w: usize) -> Tensor {
    let len = t.size()[dim as usize];
    let keep = len.min(w as i64);
    t.narrow(dim, len - keep, keep)
}
