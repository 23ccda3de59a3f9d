//! The layout's rules, read off the sources (docs/architecture.md): `src/` is folders by layer,
//! each importing only the layers below it; no file imports another in a circle; method files
//! never import each other. Test code (`mod tests`, `tests.rs`, `fixture.rs`) may read any
//! layer, as the integration tests do.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, lowest first; `lib.rs` and `main.rs` sit above them all.
const LAYERS: [&str; 8] = [
    "util", "io", "data", "config", "model", "run", "sweep", "cli",
];

/// One source file: its module path (`["model", "attention", "aha"]`), its whole text and its
/// non-test code.
struct Source {
    path: PathBuf,
    module: Vec<String>,
    text: String,
    code: String,
}

fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(&root).unwrap().with_extension("");
                let mut module: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if matches!(
                    module.last().map(String::as_str),
                    Some("mod" | "lib" | "main")
                ) {
                    module.pop();
                }
                let text = std::fs::read_to_string(&p).unwrap();
                let name = p.file_name().unwrap().to_string_lossy();
                let code = match name.as_ref() {
                    "tests.rs" | "fixture.rs" => String::new(),
                    _ => without_tests(&text),
                };
                out.push(Source {
                    path: rel.with_extension("rs"),
                    module,
                    text,
                    code,
                });
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    out
}

/// The text without its `#[cfg(test)]` items: a `mod tests { ... }` block (to its closing
/// brace), or a one-line item (`mod fixture;`, `pub(crate) use ...;`).
fn without_tests(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != "#[cfg(test)]" {
            out.push(lines[i]);
            i += 1;
            continue;
        }
        i += 1;
        // The item's lines, to where its braces (if it opens any) close.
        let mut depth = 0i64;
        while i < lines.len() {
            depth += braces(lines[i]);
            i += 1;
            if depth <= 0 {
                break;
            }
        }
    }
    out.join("\n")
}

/// Opening minus closing braces of a line of code, those in string and character literals and
/// comments not counted.
fn braces(line: &str) -> i64 {
    let (mut n, mut chars) = (0, line.chars().peekable());
    let mut in_str = false;
    while let Some(c) = chars.next() {
        match (in_str, c) {
            (true, '\\') => {
                chars.next();
            }
            (true, '"') => in_str = false,
            (true, _) => {}
            (false, '"') => in_str = true,
            (false, '\'') => {
                // A character literal ('{', '\'') or a lifetime ('a): skip the literal only.
                let rest: String = chars.clone().take(3).collect();
                if rest.starts_with('\\') {
                    chars.nth(2);
                } else if rest.chars().nth(1) == Some('\'') {
                    chars.nth(1);
                }
            }
            (false, '/') if chars.peek() == Some(&'/') => break,
            (false, '{') => n += 1,
            (false, '}') => n -= 1,
            _ => {}
        }
    }
    n
}

/// The paths a use tree names: `a::{b, c::{d, e as f}}` gives `a::b`, `a::c::d`, `a::c::e as f`.
fn expand_use(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        return vec![tree.to_string()];
    };
    let prefix = tree[..open].trim_end_matches("::");
    let inner = &tree[open + 1..tree.rfind('}').unwrap()];
    let (mut parts, mut depth, mut cur) = (Vec::new(), 0, String::new());
    for ch in inner.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if ch == ',' && depth == 0 {
            parts.push(std::mem::take(&mut cur));
        } else {
            cur.push(ch);
        }
    }
    parts.push(cur);
    parts
        .iter()
        .map(|p| p.trim())
        .filter(|p| !p.is_empty())
        .flat_map(|p| match p {
            "self" => vec![prefix.to_string()],
            _ => expand_use(&format!("{prefix}::{p}")),
        })
        .collect()
}

/// The `use` statements of `code` (which may span lines), each with whether it is public
/// (`pub use`, `pub(crate) use`).
fn use_statements(code: &str) -> Vec<(bool, String)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        let found = match t.strip_prefix("use ") {
            Some(s) => Some((false, s)),
            None => t
                .split_once(" use ")
                .filter(|(lead, _)| lead.starts_with("pub") && !lead.contains(' '))
                .map(|(_, s)| (true, s)),
        };
        if let Some((public, stmt)) = found {
            let mut tree = stmt.to_string();
            while !tree.contains(';') && i + 1 < lines.len() {
                i += 1;
                tree.push_str(lines[i]);
            }
            out.push((public, tree.split(';').next().unwrap().to_string()));
        }
        i += 1;
    }
    out
}

/// Every path a file's code reads: its `use` items (not `pub use`, which re-exports a
/// folder's children and makes no dependency) and the paths written in its code.
fn references(code: &str) -> Vec<String> {
    let children: BTreeSet<&str> = code
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';')
        })
        .collect();
    let rooted = |head: &str| matches!(head, "crate" | "super" | "self") || children.contains(head);
    let mut out = Vec::new();
    // A `pub use` re-exports and reads nothing.
    for (public, tree) in use_statements(code) {
        let head = tree.trim().split("::").next().unwrap_or("");
        if !public && rooted(head) {
            out.extend(
                expand_use(&tree)
                    .into_iter()
                    .map(|p| p.split(" as ").next().unwrap().trim().to_string()),
            );
        }
    }
    // Paths written in code: `crate::x::y`, `super::x`, `child::x`.
    for line in code.lines() {
        let t = line.trim_start();
        let public_use = t
            .split_once(" use ")
            .is_some_and(|(lead, _)| lead.starts_with("pub") && !lead.contains(' '));
        if t.starts_with("//") || t.starts_with("use ") || public_use {
            continue;
        }
        // A visibility (`pub(in crate::model::attention)`) names a module, not a dependency.
        let line = match line.split_once("pub(in ") {
            Some((before, after)) => {
                format!("{before}{}", after.split_once(')').map_or("", |x| x.1))
            }
            None => line.to_string(),
        };
        let line = line.as_str();
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let word_start = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
            let mut j = i;
            while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] == b':') {
                j += 1;
            }
            if j > i && word_start {
                let path = line[i..j].trim_end_matches(':');
                let head = path.split("::").next().unwrap();
                if path.contains("::") && rooted(head) {
                    out.push(path.to_string());
                }
            }
            i = j.max(i + 1);
        }
    }
    out
}

/// The layer of a file (index into `LAYERS`), `LAYERS.len()` for the crate's root files.
fn layer(s: &Source) -> usize {
    s.module
        .first()
        .and_then(|top| LAYERS.iter().position(|l| l == top))
        .unwrap_or(LAYERS.len())
}

/// The file an absolute path's item is defined in, following a folder's `pub use` re-exports.
fn resolve(
    files: &BTreeMap<Vec<String>, &Source>,
    segs: &[String],
    depth: usize,
) -> Option<PathBuf> {
    for k in (1..=segs.len()).rev() {
        let Some(src) = files.get(&segs[..k]) else {
            continue;
        };
        let rest = &segs[k..];
        if rest.is_empty() || depth > 8 || !src.path.ends_with("mod.rs") {
            return Some(src.path.clone());
        }
        // An item of a folder's index: the child that defines it, when the index re-exports it.
        for (_, tree) in use_statements(&src.text).into_iter().filter(|u| u.0) {
            for item in expand_use(&tree) {
                let (path, alias) = match item.split_once(" as ") {
                    Some((p, a)) => (p.to_string(), a.to_string()),
                    None => (item.clone(), item.rsplit("::").next().unwrap().to_string()),
                };
                if alias == rest[0] {
                    let mut target = absolute(&segs[..k], &path);
                    target.extend(rest[1..].iter().cloned());
                    return resolve(files, &target, depth + 1);
                }
            }
        }
        return Some(src.path.clone());
    }
    None
}

/// `path` as read in module `module`, made absolute (a file module's `super` is its folder, a
/// folder's `super` its parent: both are the module path's parent).
fn absolute(module: &[String], path: &str) -> Vec<String> {
    let segs: Vec<&str> = path.split("::").collect();
    let mut cur: Vec<String> = module.to_vec();
    let mut i = 0;
    match segs[0] {
        "crate" => {
            cur.clear();
            i = 1;
        }
        _ => {
            while segs.get(i) == Some(&"super") {
                cur.pop();
                i += 1;
            }
            if segs.get(i) == Some(&"self") {
                i += 1;
            }
        }
    }
    cur.extend(segs[i..].iter().map(|s| s.to_string()));
    cur
}

/// The file-level import graph of the crate's non-test code.
fn graph(srcs: &[Source]) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let files: BTreeMap<Vec<String>, &Source> =
        srcs.iter().map(|s| (s.module.clone(), s)).collect();
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for s in srcs {
        for r in references(&s.code) {
            let r = r.trim_end_matches("::*");
            let target = resolve(&files, &absolute(&s.module, r), 0);
            if let Some(t) = target.filter(|t| *t != s.path) {
                edges.entry(s.path.clone()).or_default().insert(t);
            }
        }
    }
    edges
}

/// What each file re-exports (`pub use`, `pub(crate) use`), as file-level edges: a folder's
/// index showing its children's items is no dependency of its own, but a re-export from a
/// layer above would be one.
fn reexports(srcs: &[Source]) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let files: BTreeMap<Vec<String>, &Source> =
        srcs.iter().map(|s| (s.module.clone(), s)).collect();
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for s in srcs {
        for (_, tree) in use_statements(&s.code).into_iter().filter(|u| u.0) {
            for item in expand_use(&tree) {
                let path = item.split(" as ").next().unwrap().trim().to_string();
                let head = path.split("::").next().unwrap();
                let child = s.code.contains(&format!("mod {head};"));
                let path = match child {
                    true => format!("self::{path}"),
                    false => path,
                };
                if !matches!(path.split("::").next(), Some("crate" | "super" | "self")) {
                    continue;
                }
                if let Some(t) = resolve(&files, &absolute(&s.module, &path), 0) {
                    edges.entry(s.path.clone()).or_default().insert(t);
                }
            }
        }
    }
    edges
}

/// The import circles of `edges`: its strongly connected components of more than one file.
fn circles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    let nodes: Vec<&PathBuf> = edges
        .keys()
        .chain(edges.values().flatten())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let reach = |from: &PathBuf| {
        let mut seen: BTreeSet<&PathBuf> = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(n) = todo.pop() {
            for m in edges.get(n).into_iter().flatten() {
                if seen.insert(m) {
                    todo.push(m);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&PathBuf, BTreeSet<&PathBuf>> =
        nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<PathBuf>> = Vec::new();
    for n in &nodes {
        let comp: Vec<PathBuf> = nodes
            .iter()
            .filter(|m| reaches[n].contains(*m) && reaches[*m].contains(*n))
            .map(|m| (*m).clone())
            .collect();
        if comp.len() > 1 && !out.contains(&comp) {
            out.push(comp);
        }
    }
    out
}

#[test]
fn layers_import_only_layers_below_them() {
    let srcs = sources();
    for s in &srcs {
        assert!(
            s.module.len() > 1 || s.module.is_empty() || LAYERS.contains(&s.module[0].as_str()),
            "{} sits outside the layer folders ({})",
            s.path.display(),
            LAYERS.join(", ")
        );
    }
    let by_path: BTreeMap<&PathBuf, &Source> = srcs.iter().map(|s| (&s.path, s)).collect();
    let mut upward = Vec::new();
    let mut edges = graph(&srcs);
    for (from, tos) in reexports(&srcs) {
        edges.entry(from).or_default().extend(tos);
    }
    for (from, tos) in edges {
        let l = layer(by_path[&from]);
        for to in tos {
            let lt = layer(by_path[&to]);
            if lt > l {
                upward.push(format!(
                    "{} ({}) imports {} ({})",
                    from.display(),
                    LAYERS.get(l).unwrap_or(&"root"),
                    to.display(),
                    LAYERS.get(lt).unwrap_or(&"root")
                ));
            }
        }
    }
    assert!(upward.is_empty(), "upward imports:\n{}", upward.join("\n"));
}

#[test]
fn no_file_imports_another_in_a_circle() {
    let srcs = sources();
    let edges = graph(&srcs);
    // The rule has teeth: the graph is read at all (every layer above util imports something).
    assert!(edges.len() > 30, "only {} files import others", edges.len());
    let found = circles(&edges);
    assert!(found.is_empty(), "import circles: {found:?}");
}

#[test]
fn method_files_never_import_each_other() {
    let srcs = sources();
    let methods: BTreeSet<PathBuf> = srcs
        .iter()
        .filter(|s| s.code.contains(": MethodSpec = "))
        .map(|s| s.path.clone())
        .collect();
    assert!(methods.len() >= 4, "method files found: {methods:?}");
    for (from, tos) in graph(&srcs) {
        if methods.contains(&from) {
            let read: Vec<&PathBuf> = tos.iter().filter(|t| methods.contains(*t)).collect();
            assert!(read.is_empty(), "{} imports {read:?}", from.display());
        }
    }
}

/// The reader finds what the rules are about: a circle and an upward import planted in
/// sources of its own are reported.
#[test]
fn the_reader_sees_circles_and_upward_imports() {
    let src = |path: &str, module: &[&str], code: &str| Source {
        path: PathBuf::from(path),
        module: module.iter().map(|s| s.to_string()).collect(),
        text: code.into(),
        code: code.into(),
    };
    let srcs = vec![
        src(
            "util/a.rs",
            &["util", "a"],
            "use crate::run::b::Thing;\nuse super::c;",
        ),
        src("run/b.rs", &["run", "b"], "fn f() { crate::util::a::g(); }"),
        src("util/c.rs", &["util", "c"], ""),
        src("util/mod.rs", &["util"], "pub mod a;\npub mod c;"),
        src("run/mod.rs", &["run"], "pub mod b;"),
    ];
    let edges = graph(&srcs);
    assert_eq!(circles(&edges).len(), 1, "{edges:?}");
    let a = &edges[&PathBuf::from("util/a.rs")];
    assert!(a.contains(&PathBuf::from("run/b.rs")) && a.contains(&PathBuf::from("util/c.rs")));
    assert!(layer(&srcs[0]) < layer(&srcs[1]));
    // A re-export reads what it shows.
    let shown = vec![
        src(
            "util/mod.rs",
            &["util"],
            "pub(crate) use crate::run::b::Thing;",
        ),
        src("run/b.rs", &["run", "b"], ""),
    ];
    let r = reexports(&shown);
    assert!(r[&PathBuf::from("util/mod.rs")].contains(&PathBuf::from("run/b.rs")));
    assert_eq!(
        expand_use("crate::x::{a, b::{C, D}, self}"),
        [
            "crate::x::a",
            "crate::x::b::C",
            "crate::x::b::D",
            "crate::x"
        ]
    );
}
