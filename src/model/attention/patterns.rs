//! Which keys each query sees under a static pattern, how many (query, key) pairs that is,
//! and the dense attention that computes it on the reference path.
//!
//! Every static pattern (full, sliding window, PPA) depends only on the distance `d = i - k`
//! between query `i` and key `k`, so one predicate, `KeyPattern::sees(d)`, defines each of
//! them; the dense mask, the pair count, the kernels' offset lists and the per-layer
//! assignment of `static_hybrid` all derive from it.

use crate::model::kernels::PpaOffsets;
use std::cell::RefCell;
use tch::{Device, Kind, Tensor};

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum KeyPattern {
    /// Causal attention over the whole prefix.
    Full,
    /// The last `w` keys, self included.
    Window(usize),
    /// The window plus the power offsets S_p (PPA).
    Ppa { power: f64, window: usize },
}

impl KeyPattern {
    /// Whether a query sees the key `d >= 0` positions before it.
    pub(crate) fn sees(&self, d: usize) -> bool {
        match *self {
            KeyPattern::Full => true,
            KeyPattern::Window(w) => d < w,
            KeyPattern::Ppa { power, window } => d < window || is_power_offset(d, power),
        }
    }

    /// `sees(d)` for d = 0 .. len.
    pub(crate) fn distance_table(&self, len: usize) -> Vec<bool> {
        (0..len).map(|d| self.sees(d)).collect()
    }

    /// Number of (query, key) pairs attended in one causal sequence of length `len`:
    /// a distance d occurs for the `len - d` queries i >= d.
    pub(crate) fn attended_pairs(&self, len: usize) -> u64 {
        self.distance_table(len)
            .iter()
            .enumerate()
            .filter(|(_, &s)| s)
            .map(|(d, _)| (len - d) as u64)
            .sum()
    }

    /// Pairs attended by the queries at positions `start .. end` (query i sees the distances
    /// d <= i the pattern allows).
    pub(crate) fn pairs_between(&self, start: usize, end: usize) -> u64 {
        let mut seen = 0u64;
        let mut total = 0u64;
        for (i, s) in self.distance_table(end).iter().enumerate() {
            seen += *s as u64;
            if i >= start {
                total += seen;
            }
        }
        total
    }

    /// Dense `[len, len]` boolean mask, true where query i (row) may attend key k (column).
    pub(crate) fn mask(&self, len: usize, device: Device) -> Tensor {
        let pos = Tensor::arange(len as i64, (Kind::Int64, device));
        let dist = pos.unsqueeze(1) - pos.unsqueeze(0);
        let causal = dist.ge(0);
        let table = Tensor::from_slice(&self.distance_table(len)).to_device(device);
        let seen = table
            .index_select(0, &dist.clamp_min(0).flatten(0, 1))
            .view([len as i64, len as i64]);
        seen.logical_and(&causal)
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

    /// Whether the dense causal kernel can stand in for the mask at this length.
    pub(crate) fn is_full_at(&self, len: usize) -> bool {
        match *self {
            KeyPattern::Full => true,
            KeyPattern::Window(w) => len <= w,
            KeyPattern::Ppa { window, .. } => {
                len <= window || self.distance_table(len).iter().all(|&s| s)
            }
        }
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
