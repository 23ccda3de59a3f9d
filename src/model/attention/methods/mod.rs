//! The methods, one file each, and their registry: every method's facts (`MethodSpec`), each
//! stated in the method's own file beside its maths. A new method adds its file, its line
//! and arm here, and its settings (`config/attention.rs`); its tests go in its file.
//!
//! | file | methods |
//! |---|---|
//! | `fixed.rs` | full, SWA, PPA, StaticHybrid: one fixed pattern per layer |
//! | `aha.rs` | AHA (and static top-k heads): full or window per token and head |
//! | `l2a.rs` | L2A: a window, and a global module for routed tokens |
//! | `swiattn.rs` | SwiAttn: a full or a window branch per token, its adaptive regulariser |

mod aha;
mod fixed;
mod l2a;
mod swiattn;

pub(crate) use aha::{top_k_name, HEAD_RANKING_COLUMNS};
#[cfg(test)]
pub(super) use {fixed::hybrid_pattern, swiattn::SwiAttnReg};

use crate::config::Method;
use crate::model::attention::base::MethodSpec;
use aha::{AHA, STATIC_HEADS};
use fixed::{FULL, PPA, STATIC_HYBRID, SWA};
use l2a::L2A;
use swiattn::SWIATTN;

/// The facts of method `m`.
pub(crate) fn spec(m: Method) -> &'static MethodSpec {
    match m {
        Method::Full => &FULL,
        Method::Swa => &SWA,
        Method::Ppa => &PPA,
        Method::StaticHybrid => &STATIC_HYBRID,
        Method::Aha => &AHA,
        Method::L2a => &L2A,
        Method::Swiattn => &SWIATTN,
        Method::StaticHeads => &STATIC_HEADS,
    }
}

/// Every method's facts, in `Method::ALL`'s order.
pub(crate) fn all() -> impl Iterator<Item = &'static MethodSpec> {
    Method::ALL.into_iter().map(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Each method's spec is its own, and the names tables, figures and the bench use are
    /// each given once.
    #[test]
    fn every_method_has_its_own_spec() {
        for m in Method::ALL {
            assert_eq!(spec(m).method, m);
        }
        let labels: BTreeSet<&str> = all().map(|s| s.label).collect();
        assert_eq!(labels.len(), Method::ALL.len());
        let bench: Vec<&str> = all().flat_map(|s| s.bench.iter().map(|b| b.name)).collect();
        assert_eq!(bench.iter().collect::<BTreeSet<_>>().len(), bench.len());
        // A method reads its window exactly when its spec says so.
        for s in all() {
            let a = crate::config::AttentionConfig {
                method: s.method,
                ..Default::default()
            };
            assert_eq!(a.reads().contains(&"window"), s.windowed, "{:?}", s.method);
        }
    }
}
