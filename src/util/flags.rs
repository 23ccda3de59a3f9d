//! Numbers in and out: parsers and checks of command-line flag values, and numbers as
//! messages and labels write them.

/// A number given as a command-line flag: finite (NaN would pass every range check after it).
pub(crate) fn finite_flag(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number")),
        Err(e) => Err(e.to_string()),
    }
}

/// `v` as a person reads it: its shortest decimal (0.0003, 64) unless that runs past 16
/// characters, then in exponent form (1e-300 rather than 300 digits, 1.5e20).
pub(crate) fn compact(v: f64) -> String {
    let plain = v.to_string();
    if plain.len() <= 16 {
        plain
    } else {
        format!("{v:e}")
    }
}

/// Refuses a list flag that names a value twice: a flag given twice adds its values to the
/// first's, so a case listed twice would run twice and be written as two rows of one key.
pub(crate) fn each_once<T: PartialEq + std::fmt::Display>(
    flag: &str,
    values: &[T],
) -> anyhow::Result<()> {
    match values
        .iter()
        .enumerate()
        .find_map(|(i, v)| values[..i].contains(v).then_some(v))
    {
        Some(v) => anyhow::bail!(
            "{flag} lists {v} twice (a flag given twice adds to the first's values): name each once"
        ),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_listed_twice_is_refused_by_name() {
        assert!(each_once("--batches", &[1, 8]).is_ok());
        let e = each_once("--batches", &[1, 8, 1]).unwrap_err().to_string();
        assert!(e.contains("--batches lists 1 twice"), "{e}");
    }

    #[test]
    fn numbers_read_compactly() {
        assert_eq!(compact(0.0003), "0.0003");
        assert_eq!(compact(0.00001), "0.00001");
        assert_eq!(compact(64.0), "64");
        assert_eq!(compact(-2.5), "-2.5");
        assert_eq!(compact(1e-300), "1e-300");
        assert_eq!(compact(1e300), "1e300");
        assert_eq!(compact(1.5e20), "1.5e20");
        assert_eq!(compact(0.1 + 0.2), "3.0000000000000004e-1");
        assert_eq!(compact(f64::INFINITY), "inf");
    }
}
