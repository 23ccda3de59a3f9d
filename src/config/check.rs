//! Range checks that name the setting they refuse.

use crate::util::flags::compact;
use anyhow::{bail, Result};

/// A bound a setting is checked against, shown as a message writes it.
pub(crate) trait Bound: PartialOrd + Copy {
    fn shown(self) -> String;
}

impl Bound for usize {
    fn shown(self) -> String {
        self.to_string()
    }
}

impl Bound for u64 {
    fn shown(self) -> String {
        self.to_string()
    }
}

impl Bound for f64 {
    fn shown(self) -> String {
        compact(self)
    }
}

/// `lo <= v <= hi`, written so that NaN (for which every comparison is false) fails it.
pub(crate) fn check<T: Bound>(key: &str, v: T, lo: T, hi: T) -> Result<()> {
    if !(v >= lo && v <= hi) {
        bail!(
            "{key} = {} is out of range: allowed {} ..= {}",
            v.shown(),
            lo.shown(),
            hi.shown()
        );
    }
    Ok(())
}

pub(crate) fn check_open_f(key: &str, v: f64, lo: f64, hi: f64) -> Result<()> {
    if !(v > lo && v < hi) {
        bail!(
            "{key} = {} is out of range: allowed strictly between {} and {}",
            compact(v),
            compact(lo),
            compact(hi)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Refusals show numbers compactly: 1e300, not 301 digits.
    #[test]
    fn refusals_show_numbers_compactly() {
        let e = check("train.weight_decay", 1e300, 0.0, 10.0)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "train.weight_decay = 1e300 is out of range: allowed 0 ..= 10"
        );
        let e = check_open_f("train.lr", -1e-300, 0.0, 10.0)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "train.lr = -1e-300 is out of range: allowed strictly between 0 and 10"
        );
        assert!(check("train.steps", 0usize, 1, 5).is_err());
    }
}
