//! The crate's sources as the layout tests read them (`tests/layers.rs`, `tests/size.rs`):
//! each file's module path, its text, and its non-test code with every literal and comment
//! blanked, so that braces, `use` lines and paths are read from code alone.
//!
//! Test code is what the compiler leaves out of a release build: items under `#[cfg(test)]`,
//! and whole files that their parent declares under it (`#[cfg(test)] mod tests;`), whatever
//! the files are called.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// One source file: its path below `src/`, its module path (`["model", "attention", "aha"]`),
/// and its non-test code (literals and comments blanked; empty for a file that is test code as
/// a whole).
pub struct Source {
    pub path: PathBuf,
    #[allow(dead_code)] // the size guard reads paths and code alone
    pub module: Vec<String>,
    pub code: String,
}

/// Every `.rs` file below `src/`, sorted by path.
pub fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<(PathBuf, Vec<String>, String)> = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(&root).unwrap().to_path_buf();
                files.push((
                    rel.clone(),
                    module_of(&rel),
                    std::fs::read_to_string(&p).unwrap(),
                ));
            }
        }
    }
    read(files)
}

/// `sources()` over given files: (path below `src/`, module path, text).
pub fn read(files: Vec<(PathBuf, Vec<String>, String)>) -> Vec<Source> {
    // Modules a parent declares under #[cfg(test)]: their files are test code as a whole.
    let mut test_modules: BTreeSet<Vec<String>> = BTreeSet::new();
    for (_, module, text) in &files {
        for child in test_children(&blank_literals(text)) {
            let mut m = module.clone();
            m.push(child);
            test_modules.insert(m);
        }
    }
    let in_test =
        |module: &[String]| (1..=module.len()).any(|k| test_modules.contains(&module[..k]));
    let mut out: Vec<Source> = files
        .into_iter()
        .map(|(path, module, text)| {
            let code = match in_test(&module) {
                true => String::new(),
                false => without_tests(&blank_literals(&text)),
            };
            Source { path, module, code }
        })
        .collect();
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// The module path of a file below `src/` (`model/attention/mod.rs` is `model::attention`).
pub fn module_of(rel: &Path) -> Vec<String> {
    let mut module: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        module.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        module.pop();
    }
    module
}

/// `text` with the contents of every comment, string, byte string, raw string and character
/// literal replaced by spaces (line breaks kept, so line numbers hold): what is left is code.
pub fn blank_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let prev_ident = i > 0 && ident(c[i - 1]);
        // Comments: `//` to the line's end, `/* */` nested.
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                blank(&mut out, c[i]);
                i += 1;
            }
            continue;
        }
        if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
            continue;
        }
        // Raw strings: r"..", r#".."#, br"..", cr#".."# (a prefix that starts a token).
        let raw_at = match (c[i], c.get(i + 1)) {
            ('r', _) if !prev_ident => Some(i + 1),
            ('b' | 'c', Some('r')) if !prev_ident => Some(i + 2),
            _ => None,
        };
        if let Some(mut j) = raw_at {
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if c.get(j) == Some(&'"') {
                out.extend(c[i..=j].iter());
                i = j + 1;
                while i < c.len() {
                    let closes = c[i] == '"' && (1..=hashes).all(|k| c.get(i + k) == Some(&'#'));
                    if closes {
                        out.extend(c[i..=i + hashes].iter());
                        i += hashes + 1;
                        break;
                    }
                    blank(&mut out, c[i]);
                    i += 1;
                }
                continue;
            }
        }
        // Strings: "..", b"..", c"..", with escapes.
        if c[i] == '"' {
            out.push('"');
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    blank(&mut out, c[i]);
                    i += 1;
                }
                if i < c.len() {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
            if i < c.len() {
                out.push('"');
                i += 1;
            }
            continue;
        }
        // Character literals ('{', '\'', '\u{7b}'), not lifetimes ('a).
        if c[i] == '\'' {
            let end = match c.get(i + 1) {
                Some('\\') => (i + 3..c.len().min(i + 12)).find(|&j| c[j] == '\''),
                Some(_) if c.get(i + 2) == Some(&'\'') => Some(i + 2),
                _ => None,
            };
            if let Some(end) = end {
                out.push('\'');
                (i + 1..end).for_each(|_| out.push(' '));
                out.push('\'');
                i = end + 1;
                continue;
            }
        }
        out.push(c[i]);
        i += 1;
    }
    out
}

/// Opening minus closing braces of a line of code (literals already blanked).
pub fn braces(line: &str) -> i64 {
    line.chars()
        .map(|c| match c {
            '{' => 1,
            '}' => -1,
            _ => 0,
        })
        .sum()
}

/// The line ranges `[start, end)` of the `#[cfg(test)]` items of blanked `code`: from the
/// attribute through any further attributes to the item's end (its `;`, or the brace that
/// closes the braces it opens).
fn test_items(code: &str) -> Vec<(usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        let Some(rest) = t.strip_prefix("#[cfg(test)]") else {
            i += 1;
            continue;
        };
        let start = i;
        // The item may start on the attribute's line; further attributes come before it.
        let mut first = rest.trim();
        while first.is_empty() || first.starts_with("#[") {
            i += 1;
            if i >= lines.len() {
                break;
            }
            first = lines[i].trim();
        }
        let mut depth = 0i64;
        let mut opened = false;
        while i < lines.len() {
            let line = if i == start { rest } else { lines[i] };
            depth += braces(line);
            opened |= line.contains('{');
            i += 1;
            let ends = if opened {
                depth <= 0
            } else {
                line.contains(';')
            };
            if ends {
                break;
            }
        }
        out.push((start, i));
    }
    out
}

/// Blanked `code` without its `#[cfg(test)]` items.
pub fn without_tests(code: &str) -> String {
    let lines: Vec<&str> = code.lines().collect();
    let items = test_items(code);
    (0..lines.len())
        .filter(|i| !items.iter().any(|&(s, e)| (s..e).contains(i)))
        .map(|i| lines[i])
        .collect::<Vec<_>>()
        .join("\n")
}

/// The child modules blanked `code` declares under `#[cfg(test)]` (`mod tests;`).
fn test_children(code: &str) -> Vec<String> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (s, e) in test_items(code) {
        for l in &lines[s..e] {
            let l = l.trim().trim_start_matches("#[cfg(test)]").trim();
            let l = l
                .strip_prefix("pub(crate) ")
                .or(l.strip_prefix("pub "))
                .unwrap_or(l);
            if let Some(name) = l.strip_prefix("mod ").and_then(|m| m.strip_suffix(';')) {
                out.push(name.trim().to_string());
            }
        }
    }
    out
}

/// The functions of blanked non-test `code`: (name, first line, lines), a function's lines
/// running from its `fn` to the brace that closes its body (bodiless trait items left out).
#[allow(dead_code)] // each test crate uses part of this module
pub fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(at) = find_word(line, "fn") else {
            continue;
        };
        let name: String = line[at + 2..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue; // a `fn(..)` type
        }
        // The body opens at the first `{` after the signature; a `;` first means none.
        let mut depth = 0i64;
        let mut opened = false;
        let mut end = None;
        'scan: for (j, l) in lines.iter().enumerate().skip(i) {
            let from = if j == i { at } else { 0 };
            for ch in l[from..].chars() {
                match ch {
                    ';' if !opened => break 'scan,
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => {
                        depth -= 1;
                        if opened && depth == 0 {
                            end = Some(j);
                            break 'scan;
                        }
                    }
                    _ => {}
                }
            }
        }
        if let Some(end) = end {
            out.push((name, i + 1, end - i + 1));
        }
    }
    out
}

/// Where `word` stands as a whole word in `line`.
fn find_word(line: &str, word: &str) -> Option<usize> {
    let b = line.as_bytes();
    let ident = |x: u8| x.is_ascii_alphanumeric() || x == b'_';
    line.match_indices(word)
        .map(|(i, _)| i)
        .find(|&i| (i == 0 || !ident(b[i - 1])) && b.get(i + word.len()).is_none_or(|&x| !ident(x)))
}

/// Lines of non-test code per file (the file without its test items), by path.
#[allow(dead_code)] // each test crate uses part of this module
pub fn code_lines(srcs: &[Source]) -> BTreeMap<PathBuf, usize> {
    srcs.iter()
        .map(|s| {
            (
                s.path.clone(),
                if s.code.is_empty() {
                    0
                } else {
                    s.code.lines().count()
                },
            )
        })
        .collect()
}
