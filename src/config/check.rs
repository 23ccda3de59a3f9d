//! Range checks that name the setting they refuse.

use anyhow::{bail, Result};

/// `lo <= v <= hi`, written so that NaN (for which every comparison is false) fails it.
pub(crate) fn check<T: PartialOrd + std::fmt::Display>(
    key: &str,
    v: T,
    lo: T,
    hi: T,
) -> Result<()> {
    if !(v >= lo && v <= hi) {
        bail!("{key} = {v} is out of range: allowed {lo} ..= {hi}");
    }
    Ok(())
}

pub(crate) fn check_open_f(key: &str, v: f64, lo: f64, hi: f64) -> Result<()> {
    if !(v > lo && v < hi) {
        bail!("{key} = {v} is out of range: allowed strictly between {lo} and {hi}");
    }
    Ok(())
}
