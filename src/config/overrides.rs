//! `--set section.key=value` overrides, applied to the TOML tree before it is parsed so they
//! obey the same rules as the file, and the refusal of non-finite numbers anywhere in a tree.

use anyhow::{bail, Context, Result};

/// Refuses NaN and infinite numbers anywhere in a TOML tree (TOML allows `nan` and `inf`, and
/// NaN would pass any range check), naming the dotted key.
pub(crate) fn reject_non_finite(tree: &toml::Table, prefix: &str) -> Result<()> {
    fn walk(v: &toml::Value, key: &str) -> Result<()> {
        match v {
            toml::Value::Float(f) if !f.is_finite() => {
                bail!("{key} = {f} is not a finite number")
            }
            toml::Value::Array(a) => a.iter().try_for_each(|x| walk(x, key)),
            toml::Value::Table(t) => reject_non_finite(t, &format!("{key}.")),
            _ => Ok(()),
        }
    }
    tree.iter()
        .try_for_each(|(k, v)| walk(v, &format!("{prefix}{k}")))
}

/// A `--set` value: a TOML value (number, bool, array, quoted string), else a bare string, so
/// `--set attention.method=swa` needs no quotes; in a list, each bare word is a string
/// (`[passkey, mqar]`).
pub(crate) fn parse_value(raw: &str) -> toml::Value {
    let raw = raw.trim();
    let toml_value = |text: &str| {
        format!("v = {text}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|mut t| t.remove("v"))
    };
    if let Some(v) = toml_value(raw) {
        return v;
    }
    match raw.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        Some(inner) if !inner.contains(['[', ']', '"', '\'']) => toml::Value::Array(
            inner
                .split(',')
                .map(str::trim)
                .filter(|w| !w.is_empty())
                .map(|w| toml_value(w).unwrap_or_else(|| toml::Value::String(w.to_string())))
                .collect(),
        ),
        _ => toml::Value::String(raw.to_string()),
    }
}

/// `section.key=value`, the value read by `parse_value`.
pub(crate) fn apply_override(tree: &mut toml::Table, spec: &str) -> Result<()> {
    let (key, raw) = spec
        .split_once('=')
        .with_context(|| format!("--set {spec:?}: expected section.key=value"))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        bail!("--set {spec:?}: key must look like section.key (e.g. attention.window)");
    }
    let value = parse_value(raw);
    // A whole number TOML cannot hold would otherwise come back as a bare string.
    let digits = raw.trim().trim_start_matches(['+', '-']);
    if value.is_str()
        && !digits.is_empty()
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_')
    {
        bail!(
            "--set {spec}: {key} = {} is out of range: no setting takes an integer beyond {}",
            raw.trim(),
            i64::MAX
        );
    }
    let mut table = tree;
    for p in &parts[..parts.len() - 1] {
        let entry = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry
            .as_table_mut()
            .with_context(|| format!("--set {spec:?}: {p} is not a section"))?;
    }
    table.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}
