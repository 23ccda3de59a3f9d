//! Every method's facts (`MethodSpec`), one entry per method, each stated in the method's own
//! file beside its maths. A new method adds its file, its arm here, its settings
//! (`config/attention.rs`) and its tests.

use super::aha::{AHA, STATIC_HEADS};
use super::base::MethodSpec;
use super::fixed::{FULL, PPA, STATIC_HYBRID, SWA};
use super::l2a::L2A;
use super::swiattn::SWIATTN;
use crate::config::Method;

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
