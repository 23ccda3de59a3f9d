//! Which keys each query sees under a static pattern, how many (query, key) pairs that is, the
//! dense attention that computes it on the reference path, which keys a decoding cache keeps
//! for it, and which kernel runs it.
//!
//! A pattern is a predicate over absolute positions, `KeyPattern::sees(query, key)`: the keys
//! at distances `d = query - key` it allows (`near`), and the sequence's first keys, which
//! every later query sees (`first`). Every other fact derives from those two: the dense mask,
//! the pair counts, the mask over a cache's positions, the keys a cache keeps, the kernels'
//! offset lists and the per-layer assignment of `static_hybrid`.

use crate::model::kernels::{Kernels, PpaOffsets};
use std::cell::RefCell;
use tch::{Device, Kind, Tensor};

/// Which keys of a cache's slot a layer keeps for the queries still to come, as its method
/// states it (`Route::keeps`, from the patterns it reads: `KeyPattern::keeps`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Keep {
    /// Every key: a later query may read the whole prefix.
    All,
    /// The sequence's first `first` keys and the last `last`: a window's rolling buffer
    /// (`first` 0), with the keys every query sees wherever they stand.
    Ends { first: usize, last: usize },
}

impl Keep {
    /// Positions held after `len` tokens.
    pub(crate) fn held(&self, len: usize) -> usize {
        match *self {
            Keep::All => len,
            Keep::Ends { first, last } => len.min(first + last),
        }
    }
}

pub(crate) const KERNEL_FAILED: &str = "attention kernel failed on inputs the model validated";

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum KeyPattern {
    /// Causal attention over the whole prefix.
    Full,
    /// The last `w` keys, self included.
    Window(usize),
    /// The window plus the power offsets S_p (PPA).
    Ppa { power: f64, window: usize },
    /// The window plus the sequence's first `sinks` keys (attention sinks).
    Sinks { sinks: usize, window: usize },
}

impl KeyPattern {
    /// Whether a query sees the key `d >= 0` positions before it, wherever they stand.
    fn near(&self, d: usize) -> bool {
        match *self {
            KeyPattern::Full => true,
            KeyPattern::Window(w) | KeyPattern::Sinks { window: w, .. } => d < w,
            KeyPattern::Ppa { power, window } => d < window || is_power_offset(d, power),
        }
    }

    /// How many of the sequence's first keys every later query sees, whatever their distance.
    fn first(&self) -> usize {
        match *self {
            KeyPattern::Sinks { sinks, .. } => sinks,
            _ => 0,
        }
    }

    /// Whether the query at position `query` sees the key at position `key <= query`: the
    /// predicate every derived fact (mask, pair counts, the mask over a cache) is tested
    /// against.
    #[cfg(test)]
    pub(crate) fn sees(&self, query: usize, key: usize) -> bool {
        self.near(query - key) || key < self.first()
    }

    /// `near(d)` for d = 0 .. len.
    fn distance_table(&self, len: usize) -> Vec<bool> {
        (0..len).map(|d| self.near(d)).collect()
    }

    /// Number of (query, key) pairs attended in one causal sequence of length `len`.
    pub(crate) fn attended_pairs(&self, len: usize) -> u64 {
        self.pairs_per_query(len).iter().sum()
    }

    /// Keys seen by the query at each position 0 .. len: the distances d <= i that `near`
    /// allows, and the first keys beyond them.
    pub(crate) fn pairs_per_query(&self, len: usize) -> Vec<u64> {
        let mut seen = 0u64;
        self.distance_table(len)
            .iter()
            .enumerate()
            .map(|(i, s)| {
                seen += *s as u64;
                let first = (0..self.first().min(i + 1)).filter(|&k| !self.near(i - k));
                seen + first.count() as u64
            })
            .collect()
    }

    /// PPA's `near(d)` for d = 0 .. len as a bool tensor on `device` (the lookup `seen_in`
    /// reads); None for the patterns whose reach is a comparison.
    pub(crate) fn near_table(&self, len: usize, device: Device) -> Option<Tensor> {
        matches!(self, KeyPattern::Ppa { .. })
            .then(|| Tensor::from_slice(&self.distance_table(len)).to_device(device))
    }

    /// Where queries at positions `qpos: [n]` see keys at positions `kpos: [m]` (`[n, m]`
    /// bool, on their device): the causal pairs the pattern allows; `len` is one past the
    /// highest query position.
    pub(crate) fn seen(&self, qpos: &Tensor, kpos: &Tensor, len: usize) -> Tensor {
        self.seen_in(qpos, kpos, self.near_table(len, qpos.device()).as_ref())
    }

    /// `seen` with PPA's `near_table` built beforehand (one long enough for every distance),
    /// so nothing is copied from the host: what a decoding step captured as a graph runs.
    pub(crate) fn seen_in(&self, qpos: &Tensor, kpos: &Tensor, table: Option<&Tensor>) -> Tensor {
        let dist = qpos.unsqueeze(1) - kpos.unsqueeze(0);
        let causal = dist.ge(0);
        let near = match *self {
            KeyPattern::Full => causal.shallow_clone(),
            KeyPattern::Window(w) | KeyPattern::Sinks { window: w, .. } => dist.lt(w as i64),
            KeyPattern::Ppa { .. } => {
                let table = table.expect("PPA reads its near_table");
                let last = table.size()[0] - 1;
                table
                    .index_select(0, &dist.clamp(0, last).flatten(0, 1))
                    .view([qpos.size()[0], kpos.size()[0]])
            }
        };
        let seen = match self.first() {
            0 => near,
            first => near.logical_or(&kpos.lt(first as i64).unsqueeze(0)),
        };
        seen.logical_and(&causal)
    }

    /// Dense `[len, len]` boolean mask, true where query i (row) may attend key k (column).
    pub(crate) fn mask(&self, len: usize, device: Device) -> Tensor {
        let pos = Tensor::arange(len as i64, (Kind::Int64, device));
        self.seen(&pos, &pos, len)
    }

    /// The distances below `len` that PPA sees beyond its window (ascending); empty for the
    /// other patterns.
    pub(crate) fn offsets_beyond_window(&self, len: usize) -> Vec<i32> {
        match *self {
            KeyPattern::Ppa { power, window } => (window..len)
                .filter(|&d| is_power_offset(d, power))
                .map(|d| d as i32)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Whether every query of a sequence of `len` tokens sees every earlier key, so the dense
    /// causal kernel can stand in for the mask.
    pub(crate) fn is_full_at(&self, len: usize) -> bool {
        match *self {
            KeyPattern::Full => true,
            KeyPattern::Window(w) => len <= w,
            KeyPattern::Ppa { window, .. } => len <= window || (0..len).all(|d| self.near(d)),
            // The last query sees the sinks and its window: every key where they meet.
            KeyPattern::Sinks { sinks, window } => len <= sinks + window,
        }
    }

    /// What the decode kernel reads besides PPA's `near_table`: the window (-1: every earlier
    /// key; 0 where the near table says it all) and the first keys every query sees.
    pub(crate) fn reach(&self) -> (i64, i64) {
        match *self {
            KeyPattern::Full => (-1, 0),
            KeyPattern::Window(w) => (w as i64, 0),
            KeyPattern::Ppa { .. } => (0, 0),
            KeyPattern::Sinks { sinks, window } => (window as i64, sinks as i64),
        }
    }

    /// The keys a decoding cache keeps for the queries still to come.
    pub(crate) fn keeps(&self) -> Keep {
        match *self {
            KeyPattern::Window(w) => Keep::Ends { first: 0, last: w },
            // A ring of the last w keys beside the sinks.
            KeyPattern::Sinks { sinks, window } => Keep::Ends {
                first: sinks,
                last: window,
            },
            // Full attention, and PPA, which reaches back to its oldest offset, keep everything.
            KeyPattern::Full | KeyPattern::Ppa { .. } => Keep::All,
        }
    }

    /// The pattern over a chunk's own keys on the kernel library (`q: [B, H, L, D]`, `k, v:
    /// [B, Hkv, L, D]`), with the forward's offset lists; None where it has no kernel of its
    /// own (full attention runs the fused causal kernel of `attend`).
    pub(crate) fn on_kernels(
        &self,
        kern: &Kernels,
        masks: &MaskCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Option<Tensor> {
        let out = match *self {
            KeyPattern::Full => return None,
            KeyPattern::Window(w) => kern.list_attention(q, k, v, None, w as i64),
            KeyPattern::Ppa { window, .. } => match masks.ppa_offsets(*self) {
                None => kern.list_attention(q, k, v, None, window as i64),
                Some(offsets) => kern.ppa_attention(q, k, v, window as i64, &offsets),
            },
            KeyPattern::Sinks { sinks, window } => {
                kern.sink_attention(q, k, v, window as i64, sinks as i64)
            }
        };
        Some(out.expect(KERNEL_FAILED))
    }
}

/// PPA offset set: `j in S_p` iff `floor(j^p) - floor((j-1)^p) = 1`, with `0^p = 0` for
/// p > 0. (For p = 0 every `j^0 = 1` and `0^0 = 1`, so S_0 is empty and PPA is SWA.)
pub(crate) fn is_power_offset(j: usize, p: f64) -> bool {
    if j == 0 {
        return false;
    }
    let floor_pow = |x: usize| -> f64 {
        let v = (x as f64).powf(p);
        // powf may land a hair below an exact integer (256^0.125 -> 1.9999999999999998);
        // nudge so exact powers floor to the right integer.
        (v + 1e-9 * v.max(1.0)).floor()
    };
    floor_pow(j) - floor_pow(j - 1) == 1.0
}

/// Reference attention over `q: [B, H, L, D]`, `k, v: [B, Hkv, L, D]`: softmax over the keys
/// the pattern allows. Full attention goes to the fused causal kernel; other patterns pass
/// their dense mask (correct everywhere, fast nowhere: the CUDA kernels replace it).
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pattern: &KeyPattern,
    mask: Option<&Tensor>,
) -> Tensor {
    let gqa = q.size()[1] != k.size()[1];
    let len = q.size()[2] as usize;
    if pattern.is_full_at(len) {
        Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, gqa)
    } else {
        let owned;
        let mask = match mask {
            Some(m) => m,
            None => {
                owned = pattern.mask(len, q.device());
                &owned
            }
        };
        Tensor::scaled_dot_product_attention(q, k, v, Some(mask), 0.0, false, None, gqa)
    }
}

/// Dense masks and PPA offset lists built once per forward and shared by the layers that use
/// the same pattern.
pub(crate) struct MaskCache {
    len: usize,
    device: Device,
    masks: RefCell<Vec<(KeyPattern, Tensor)>>,
    ppa: RefCell<Vec<(KeyPattern, Option<PpaOffsets>)>>,
}

impl MaskCache {
    pub(crate) fn new(len: usize, device: Device) -> Self {
        MaskCache {
            len,
            device,
            masks: RefCell::new(Vec::new()),
            ppa: RefCell::new(Vec::new()),
        }
    }

    /// Whether this cache is of sequences of `len` tokens on `device`.
    pub(crate) fn fits(&self, len: usize, device: Device) -> bool {
        self.len == len && self.device == device
    }

    /// PPA `pattern`'s offsets beyond its window at this length (int32, on the device),
    /// built and copied at most once per forward; None where no offset reaches beyond the
    /// window, so the window kernels alone run it.
    pub(super) fn ppa_offsets(&self, pattern: KeyPattern) -> Option<PpaOffsets> {
        let mut all = self.ppa.borrow_mut();
        if let Some((_, offsets)) = all.iter().find(|(p, _)| *p == pattern) {
            return offsets.as_ref().map(PpaOffsets::shallow_clone);
        }
        let KeyPattern::Ppa { window, .. } = pattern else {
            return None;
        };
        let offsets = pattern.offsets_beyond_window(self.len);
        let offsets = (!offsets.is_empty()).then(|| PpaOffsets::new(&offsets, window, self.device));
        all.push((pattern, offsets.as_ref().map(PpaOffsets::shallow_clone)));
        offsets
    }

    /// `pattern` applied to (q, k, v), with the mask built at most once per forward.
    pub(crate) fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, pattern: KeyPattern) -> Tensor {
        if pattern.is_full_at(self.len) {
            return attend(q, k, v, &pattern, None);
        }
        let mut masks = self.masks.borrow_mut();
        if !masks.iter().any(|(p, _)| *p == pattern) {
            masks.push((pattern, pattern.mask(self.len, self.device)));
        }
        let mask = &masks
            .iter()
            .find(|(p, _)| *p == pattern)
            .expect("just inserted")
            .1;
        attend(q, k, v, &pattern, Some(mask))
    }
}
