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
