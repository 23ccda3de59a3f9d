//! Where a layer's keys and values come from in one forward: the chunk being processed alone
//! (training, whole-sequence evaluation), or a decoding cache the chunk extends.
//!
//! A decoding cache is allocated once for the positions a sequence may reach (its capacity:
//! prompt and generated tokens) and keeps what later tokens may read (`Keep`, as the method
//! states it): every key, or a window's ring of the last w keys beside the first keys every
//! query sees. Its bytes are the bytes allocated. Each entry records the absolute position it
//! holds, and the position of the next token lives on the device (`CacheState::pos`): a
//! decoding step reads no number from the host that changes between steps, so one step
//! captured as a CUDA graph replays at every later position.

use super::patterns::{Keep, KeyPattern, MaskCache};
use crate::model::kernels::{kernel_for, Kernels};
use crate::model::nn::Rope;
use std::cell::RefCell;
use tch::{Device, Kind, Tensor};

/// One stream of cached keys and values (`[B, Hkv, S, D]`) and the absolute position each of
/// its S entries holds (int64 `[S]`, -1 where empty).
struct Slot {
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    /// After a chunk of several tokens past the prefill: the positions of the keys `extend`
    /// handed out (the entries before the chunk, then the chunk's own), which its queries
    /// attend over; the ring may already have dropped some of them for the chunk's last keys.
    merged: Option<Tensor>,
}

/// A layer's decoding cache: slot 0 holds the attention's keys and values, slot 1 those of
/// L2A's global module, each keeping what its `Keep` says.
pub(crate) struct LayerCache {
    keeps: Vec<Keep>,
    slots: [Option<Slot>; 2],
}

impl LayerCache {
    /// An empty cache for a layer whose slots keep `keeps` (`Route::keeps`).
    pub(crate) fn new(keeps: Vec<Keep>) -> Self {
        LayerCache {
            keeps,
            slots: [None, None],
        }
    }

    /// Bytes allocated (keys and values).
    pub(crate) fn bytes(&self) -> f64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| (s.k.numel() + s.v.numel()) as f64 * s.k.kind().elt_size_in_bytes() as f64)
            .sum()
    }
}

/// What every layer's cache of one decoded batch shares: its capacity, how many tokens it
/// holds (on the host and on the device), the rotary angles of every position, and per key
/// pattern the tables a step reads instead of host numbers.
pub(crate) struct CacheState {
    /// Positions a sequence may reach.
    pub(crate) capacity: i64,
    /// Tokens held: the host's count, which only decisions outside a captured step read
    /// (whether a chunk is the prefill).
    pub(crate) len: i64,
    /// Tokens held on the device (int64 `[1]`): the position of the next chunk's first token.
    pub(crate) pos: Tensor,
    rope: Rope,
    /// The kernel library of the model (None: the reference path).
    pub(crate) kernels: Option<&'static Kernels>,
    /// Per pattern: keys seen by a query at each position (fp64 `[capacity]`) and PPA's
    /// `near_table`.
    tables: RefCell<Vec<(KeyPattern, Tensor, Option<Tensor>)>>,
    /// What every layer of the chunk being processed shares, computed at the first layer that
    /// needs it (a few launches a step, not a few a layer) and dropped when the chunk ends:
    /// a single token's ring entry per slot shape, the chunk's pairs per pattern.
    shared: RefCell<Shared>,
}

#[derive(Default)]
struct Shared {
    rings: Vec<((Keep, i64), Tensor)>,
    pairs: Vec<((KeyPattern, i64), Tensor)>,
}

impl CacheState {
    /// `rope` holds the angles of positions 0 .. capacity.
    pub(crate) fn new(
        capacity: i64,
        rope: Rope,
        kernels: Option<&'static Kernels>,
        device: Device,
    ) -> Self {
        CacheState {
            capacity,
            len: 0,
            pos: Tensor::zeros([1], (Kind::Int64, device)),
            rope,
            kernels,
            tables: RefCell::new(Vec::new()),
            shared: RefCell::new(Shared::default()),
        }
    }

    /// Positions of a chunk of `n` tokens after those held, on the device.
    fn positions(&self, n: i64) -> Tensor {
        match n {
            1 => self.pos.shallow_clone(),
            _ => &self.pos + Tensor::arange(n, (Kind::Int64, self.pos.device())),
        }
    }

    /// The rotary angles of the next `n` positions.
    pub(crate) fn rope(&self, n: i64) -> Rope {
        self.rope.at(&self.positions(n))
    }

    /// Records `n` more tokens held.
    pub(crate) fn advance(&mut self, n: i64) {
        let _ = self.pos.g_add_scalar_(n);
        self.len += n;
        *self.shared.borrow_mut() = Shared::default();
    }

    /// Records one token held after a captured step was replayed: the replay advanced the
    /// device's position itself (the captured `advance`), so only the host's count moves.
    pub(crate) fn replayed(&mut self) {
        self.len += 1;
    }

    /// The entry of a slot of `size` that keeps `keep` where a single token's keys go.
    fn ring(&self, keep: Keep, size: i64) -> Tensor {
        let mut shared = self.shared.borrow_mut();
        if let Some((_, t)) = shared.rings.iter().find(|(k, _)| *k == (keep, size)) {
            return t.shallow_clone();
        }
        let t = ring(&self.pos, keep, size);
        shared.rings.push(((keep, size), t.shallow_clone()));
        t
    }

    /// Pairs `pattern` attends for the chunk's `n` queries over `streams` (rows times heads):
    /// once a chunk for every layer alike, not a product a layer.
    fn chunk_pairs(&self, pattern: KeyPattern, n: i64, streams: i64) -> Tensor {
        if let Some((_, t)) = self
            .shared
            .borrow()
            .pairs
            .iter()
            .find(|(p, _)| *p == (pattern, streams))
        {
            return t.shallow_clone();
        }
        let t = self
            .table(pattern)
            .0
            .index_select(0, &self.positions(n))
            .sum(Kind::Double)
            * streams as f64;
        self.shared
            .borrow_mut()
            .pairs
            .push(((pattern, streams), t.shallow_clone()));
        t
    }

    /// `pattern`'s (pairs per query position, near table), built once per cache.
    fn table(&self, pattern: KeyPattern) -> (Tensor, Option<Tensor>) {
        let mut all = self.tables.borrow_mut();
        if let Some((_, pairs, near)) = all.iter().find(|(p, ..)| *p == pattern) {
            return (
                pairs.shallow_clone(),
                near.as_ref().map(Tensor::shallow_clone),
            );
        }
        let device = self.pos.device();
        let per: Vec<f64> = pattern
            .pairs_per_query(self.capacity as usize)
            .into_iter()
            .map(|p| p as f64)
            .collect();
        let pairs = Tensor::from_slice(&per).to_device(device);
        let near = pattern.near_table(self.capacity as usize, device);
        all.push((
            pattern,
            pairs.shallow_clone(),
            near.as_ref().map(Tensor::shallow_clone),
        ));
        (pairs, near)
    }
}

/// Where a layer's keys and values come from: the chunk being processed alone (training,
/// whole-sequence evaluation), or a decoding cache the chunk's keys extend.
pub(crate) enum Keys<'a> {
    Chunk(&'a MaskCache),
    Cache {
        cache: &'a RefCell<LayerCache>,
        state: &'a CacheState,
    },
}

impl Keys<'_> {
    /// Position of the chunk's first token, as the host knows it: for decisions that hold at
    /// every later step alike (a captured step reads positions from `positions`).
    pub(super) fn start(&self) -> i64 {
        match self {
            Keys::Chunk(_) => 0,
            Keys::Cache { state, .. } => state.len,
        }
    }

    /// Positions of the chunk's `n` tokens (int64 `[n]`, on `device`).
    pub(super) fn positions(&self, n: i64, device: Device) -> Tensor {
        match self {
            Keys::Chunk(_) => Tensor::arange(n, (Kind::Int64, device)),
            Keys::Cache { state, .. } => state.positions(n),
        }
    }

    /// Pairs `pattern` attends for the chunk's `n` queries over `streams` (rows times heads):
    /// an fp64 scalar tensor, so counting never waits for the device.
    pub(super) fn pattern_pairs(&self, pattern: KeyPattern, n: i64, streams: i64) -> Tensor {
        match self {
            Keys::Chunk(_) => {
                Tensor::from(pattern.attended_pairs(n as usize) as f64 * streams as f64)
            }
            Keys::Cache { state, .. } => state.chunk_pairs(pattern, n, streams),
        }
    }

    /// Whether the chunk is a prefill into an empty cache, which attends over its own keys as
    /// a forward over the chunk does.
    pub(super) fn prefill_only(&self) -> bool {
        matches!(self, Keys::Cache { state, .. } if state.len == 0)
    }

    /// Writes the chunk's keys and values into `slot` and returns those its queries attend
    /// over: the chunk's own in a prefill, else the slot's entries (with the chunk's, for a
    /// chunk of several tokens).
    pub(super) fn extend(&self, slot: usize, k: Tensor, v: Tensor) -> (Tensor, Tensor) {
        let Keys::Cache { cache, state } = self else {
            return (k, v);
        };
        let mut c = cache.borrow_mut();
        let keep = c.keeps[slot];
        let size = keep.held(state.capacity as usize) as i64;
        let s = c.slots[slot].get_or_insert_with(|| {
            let shape = |t: &Tensor| {
                let [b, h, _, d] = t.size()[..] else {
                    unreachable!("keys are [B, Hkv, T, D]")
                };
                [b, h, size, d]
            };
            Slot {
                k: k.new_zeros(shape(&k), (k.kind(), k.device())),
                v: v.new_zeros(shape(&v), (v.kind(), v.device())),
                pos: Tensor::full([size], -1, (Kind::Int64, k.device())),
                merged: None,
            }
        });
        let n = k.size()[2];
        assert!(
            state.len + n <= state.capacity,
            "a decoding cache of {} positions was given {} more after {}",
            state.capacity,
            n,
            state.len
        );
        let out = match (state.len, n) {
            (0, _) => (k.shallow_clone(), v.shallow_clone()),
            (_, 1) => (s.k.shallow_clone(), s.v.shallow_clone()),
            _ => {
                s.merged = Some(Tensor::cat(&[&s.pos, &state.positions(n)], 0));
                (Tensor::cat(&[&s.k, &k], 2), Tensor::cat(&[&s.v, &v], 2))
            }
        };
        if n == 1 {
            let at = state.ring(keep, size);
            let _ = s.k.index_copy_(2, &at, &k);
            let _ = s.v.index_copy_(2, &at, &v);
            let _ = s.pos.index_copy_(0, &at, &state.pos);
        } else {
            // Several tokens (outside any captured step): the ranges of the chunk the slot
            // keeps, their indices made on the device (a copy from the host would wait for
            // the device at every layer of a prefill).
            let opts = (Kind::Int64, k.device());
            let ranges: Vec<Tensor> = kept_ranges(keep, state.len, n)
                .into_iter()
                .filter(|(a, b)| a < b)
                .map(|(a, b)| Tensor::arange_start(a, b, opts))
                .collect();
            let from = Tensor::cat(&ranges, 0);
            let pos = &from + state.len;
            let at = ring(&pos, keep, size);
            let _ = s.k.index_copy_(2, &at, &k.index_select(2, &from));
            let _ = s.v.index_copy_(2, &at, &v.index_select(2, &from));
            let _ = s.pos.index_copy_(0, &at, &pos);
        }
        out
    }

    /// The library that runs this chunk as a decoding step in one launch (`write_step`): a
    /// single token after a prefill, on `kernels` where they take `x`'s dtype; else None.
    pub(super) fn step_kernels(
        &self,
        x: &Tensor,
        kernels: Option<&'static Kernels>,
    ) -> Option<&'static Kernels> {
        match self {
            Keys::Cache { state, .. } if state.len > 0 && x.size()[1] == 1 => {
                kernel_for(kernels, x)
            }
            _ => None,
        }
    }

    /// `extend` for a decoding step from its joined projections `qkv: [B, 1, (H + 2 Hkv) D]`,
    /// with the rotation of q and k on the way (`Kernels::decode_step`, one launch): the
    /// rotated `q: [B, H, 1, D]` and the slot's keys and values the step attends over.
    pub(super) fn write_step(
        &self,
        slot: usize,
        kern: &Kernels,
        qkv: &Tensor,
        heads: i64,
        rope: &Rope,
    ) -> (Tensor, Tensor, Tensor) {
        let Keys::Cache { cache, state } = self else {
            unreachable!("a step runs over a cache (step_kernels)")
        };
        assert!(
            state.len < state.capacity,
            "a decoding cache of {} positions was given one more after {}",
            state.capacity,
            state.len
        );
        let mut c = cache.borrow_mut();
        let keep = c.keeps[slot];
        let size = keep.held(state.capacity as usize) as i64;
        let s = c.slots[slot]
            .as_mut()
            .expect("the prefill allocated the slot");
        let at = state.ring(keep, size);
        let (cos, sin) = rope.angles();
        let q = kern
            .decode_step(qkv, cos, sin, &at, &state.pos, heads, &s.k, &s.v, &s.pos)
            .expect("decode step kernel on the cache's own tensors");
        (q, s.k.shallow_clone(), s.v.shallow_clone())
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
        let (cache, state) = match self {
            Keys::Chunk(masks) => return masks.attend(q, k, v, pattern),
            Keys::Cache { cache, state } => (cache, state),
        };
        let n = q.size()[2];
        if state.len == 0 {
            return MaskCache::new(n as usize, q.device()).attend(q, k, v, pattern);
        }
        let c = cache.borrow();
        let s = c.slots[slot].as_ref().expect("extended before attending");
        let kpos = s.merged.as_ref().filter(|_| n > 1).unwrap_or(&s.pos);
        let (_, near) = state.table(pattern);
        // The decode kernel takes GQA groups of up to 8 query heads a key-value head.
        let group = q.size()[1] / k.size()[1];
        if let (Some(kern), 1, Device::Cuda(_), 1..=8) = (state.kernels, n, q.device(), group) {
            let (window, sinks) = pattern.reach();
            return kern
                .decode_attention(q, k, v, kpos, &state.pos, window, sinks, near.as_ref())
                .expect("decode kernel on the cache's own tensors");
        }
        let seen = pattern
            .seen_in(&state.positions(n), kpos, near.as_ref())
            .logical_and(&kpos.ge(0).unsqueeze(0));
        let gqa = q.size()[1] != k.size()[1];
        Tensor::scaled_dot_product_attention(q, k, v, Some(&seen), 0.0, false, None, gqa)
    }
}

/// The indices of a chunk of `n` tokens after `len` held that a slot keeping `keep` holds
/// once they are written: the sequence's first keys and the last of a ring, as two ranges
/// `[a, b)` of the chunk (either may be empty).
fn kept_ranges(keep: Keep, len: i64, n: i64) -> [(i64, i64); 2] {
    match keep {
        Keep::All => [(0, n), (n, n)],
        Keep::Ends { first, last } => {
            let head = (first as i64 - len).clamp(0, n);
            let tail = (n - last as i64).clamp(head, n);
            [(0, head), (tail, n)]
        }
    }
}

/// The entries of a slot of `size` entries that hold the positions `pos` (int64, on the
/// device): the first keys at their own positions, the others round the ring after them.
fn ring(pos: &Tensor, keep: Keep, size: i64) -> Tensor {
    match keep {
        Keep::Ends { first, .. } if size > first as i64 => {
            let first = first as i64;
            let wrapped = (pos - first).remainder(size - first) + first;
            pos.where_self(&pos.lt(first), &wrapped)
        }
        _ => pos.shallow_clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept ranges hold exactly the positions a slot keeps: its first keys, and the last
    /// `last` of those written so far.
    #[test]
    fn kept_ranges_hold_the_first_and_the_last_keys() {
        for keep in [
            Keep::All,
            Keep::Ends { first: 0, last: 5 },
            Keep::Ends { first: 3, last: 4 },
        ] {
            for len in 0..12 {
                for n in 1..12 {
                    let want: Vec<i64> = (0..n)
                        .filter(|&i| match keep {
                            Keep::All => true,
                            Keep::Ends { first, last } => {
                                len + i < first as i64 || len + i >= len + n - last as i64
                            }
                        })
                        .collect();
                    let got: Vec<i64> = kept_ranges(keep, len, n)
                        .into_iter()
                        .flat_map(|(a, b)| a..b)
                        .collect();
                    assert_eq!(got, want, "{keep:?} after {len}, {n} more");
                }
            }
        }
    }
}
