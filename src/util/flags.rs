//! Parsers of command-line flag values.

/// A number given as a command-line flag: finite (NaN would pass every range check after it).
pub(crate) fn finite_flag(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number")),
        Err(e) => Err(e.to_string()),
    }
}
