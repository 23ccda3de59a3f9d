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
//! | `sinks.rs` | attention sinks: the sequence's first tokens and the window |

mod aha;
mod fixed;
mod l2a;
mod sinks;
mod swiattn;

pub(crate) use aha::{UsageRamp, HEAD_RANKING_COLUMNS};
#[cfg(test)]
pub(super) use {fixed::hybrid_pattern, swiattn::SwiAttnReg};

use crate::config::Method;
use crate::model::attention::spec::MethodSpec;
use aha::{AHA, STATIC_HEADS};
use fixed::{FULL, PPA, STATIC_HYBRID, SWA};
use l2a::L2A;
use sinks::SINKS;
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
        Method::Sinks => &SINKS,
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

    /// Each method's spec is its own, and the names tables, figures, the bench and the tests
    /// use are each given once: labels, bench variants, examples, setting columns (beside the
    /// shared ones) and table files; one method is the reference; every method has an example
    /// that sets it.
    #[test]
    fn every_method_has_its_own_spec() {
        use crate::model::attention::spec::{Report, SHARED_COLUMNS};
        for m in Method::ALL {
            assert_eq!(spec(m).method, m);
        }
        let once = |names: Vec<&str>, what: &str| {
            let set: BTreeSet<&str> = names.iter().copied().collect();
            assert_eq!(set.len(), names.len(), "{what} given twice: {names:?}");
        };
        once(all().map(|s| s.label).collect(), "labels");
        once(
            all().flat_map(|s| s.bench.iter().map(|b| b.name)).collect(),
            "bench variants",
        );
        once(
            all()
                .flat_map(|s| s.examples.iter().map(|e| e.name))
                .collect(),
            "examples",
        );
        once(
            SHARED_COLUMNS
                .iter()
                .chain(all().flat_map(|s| s.columns))
                .map(|c| c.name)
                .collect(),
            "setting columns",
        );
        let files = |s: &MethodSpec| {
            s.reports.iter().filter_map(|r| match r {
                Report::Table(t) => Some(t.file),
                Report::HeadGaps { file } => Some(*file),
                _ => None,
            })
        };
        once(all().flat_map(files).collect(), "table files");
        assert_eq!(all().filter(|s| s.reference).count(), 1);
        for s in all() {
            assert!(!s.examples.is_empty(), "{:?} has no example", s.method);
            for e in s.examples {
                let mut a = crate::config::AttentionConfig::default();
                (e.set)(&mut a);
                assert_eq!(a.method, s.method, "example {} sets another method", e.name);
            }
        }
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
