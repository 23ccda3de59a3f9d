//! The layout's rules, read off the sources and docs/architecture.md: `src/` is folders by
//! layer, each importing only the layers the document's table lets it (io and data side by
//! side, each on util alone); no file imports another in a circle; method files never import
//! each other; the document names every file. Test code (`source.rs` says what counts) may
//! read any layer, as the integration tests do.

mod source;
use source::{blank_literals, module_of, read, sources, without_tests, Source};

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// docs/architecture.md.
fn architecture() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
        .unwrap()
}

/// The layers and what each may import, from the document's table of folders (`| `util/` |
/// nothing of the crate | ...`, `| `config/` | util, data | ...`), in its order.
fn layers(doc: &str) -> Vec<(String, BTreeSet<String>)> {
    let mut out: Vec<(String, BTreeSet<String>)> = Vec::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let [_, folder, may, _, ..] = cells[..] else {
            continue;
        };
        let Some(name) = folder.strip_prefix('`').and_then(|f| f.strip_suffix("/`")) else {
            continue;
        };
        if name.contains('/')
            || !may
                .chars()
                .all(|c| c.is_ascii_lowercase() || ", ".contains(c))
        {
            continue;
        }
        let allowed = match may {
            "nothing of the crate" => BTreeSet::new(),
            _ => may.split(", ").map(String::from).collect(),
        };
        out.push((name.to_string(), allowed));
    }
    out
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

/// The layer of a file: its top folder, None for the crate's root files (`lib.rs`, `main.rs`).
fn layer(s: &Source) -> Option<&str> {
    match s.module.first() {
        Some(top) if s.module.len() > 1 || s.path.ends_with("mod.rs") => Some(top),
        _ => None,
    }
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
        for (_, tree) in use_statements(&src.code).into_iter().filter(|u| u.0) {
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

/// Every import between layers that the document's table does not allow, as a line each
/// (`data/x.rs (data) imports io/y.rs (io)`); root files may import any layer, and no layer a
/// root file.
fn forbidden(srcs: &[Source], doc: &str) -> Vec<String> {
    let allowed: BTreeMap<String, BTreeSet<String>> = layers(doc).into_iter().collect();
    let by_path: BTreeMap<&PathBuf, &Source> = srcs.iter().map(|s| (&s.path, s)).collect();
    let mut edges = graph(srcs);
    for (from, tos) in reexports(srcs) {
        edges.entry(from).or_default().extend(tos);
    }
    let mut out = Vec::new();
    for (from, tos) in edges {
        let Some(lf) = layer(by_path[&from]) else {
            continue;
        };
        for to in tos {
            let lt = layer(by_path[&to]);
            let ok =
                lt.is_some_and(|lt| lt == lf || allowed.get(lf).is_some_and(|a| a.contains(lt)));
            if !ok {
                out.push(format!(
                    "{} ({lf}) imports {} ({})",
                    from.display(),
                    to.display(),
                    lt.unwrap_or("root")
                ));
            }
        }
    }
    out
}

#[test]
fn layers_import_only_what_the_document_allows() {
    let doc = architecture();
    let table = layers(&doc);
    let names: Vec<&str> = table.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["util", "io", "data", "config", "model", "run", "sweep", "cli"],
        "the document's table of folders"
    );
    let srcs = sources();
    for s in &srcs {
        assert!(
            layer(s).is_none_or(|l| names.contains(&l)),
            "{} sits outside the layer folders ({})",
            s.path.display(),
            names.join(", ")
        );
    }
    let bad = forbidden(&srcs, &doc);
    assert!(
        bad.is_empty(),
        "imports the document does not allow:\n{}",
        bad.join("\n")
    );
}

/// The document names every file below `src/` by its path there (`util/atomic.rs`).
#[test]
fn the_document_names_every_file() {
    let doc = architecture();
    let missing: Vec<String> = sources()
        .iter()
        .map(|s| s.path.to_string_lossy().into_owned())
        .filter(|p| !doc.contains(&format!("`{p}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/architecture.md does not name: {}",
        missing.join(", ")
    );
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

/// Sources of the reader's own, as (path below `src/`, text).
fn planted(files: &[(&str, &str)]) -> Vec<Source> {
    read(
        files
            .iter()
            .map(|(p, t)| (PathBuf::from(p), module_of(Path::new(p)), t.to_string()))
            .collect(),
    )
}

/// The reader finds what the rules are about: a circle and imports the table forbids,
/// planted in sources of its own, are reported; so is a production module named like test
/// code, and code after a multi-line string holding a brace.
#[test]
fn the_reader_sees_circles_and_forbidden_imports() {
    let doc = architecture();
    let srcs = planted(&[
        ("util/a.rs", "use crate::run::b::Thing;\nuse super::c;"),
        ("run/b.rs", "fn f() { crate::util::a::g(); }"),
        ("util/c.rs", ""),
        ("util/mod.rs", "pub mod a;\npub mod c;"),
        ("run/mod.rs", "pub mod b;"),
    ]);
    let edges = graph(&srcs);
    assert_eq!(circles(&edges).len(), 1, "{edges:?}");
    let a = &edges[&PathBuf::from("util/a.rs")];
    assert!(a.contains(&PathBuf::from("run/b.rs")) && a.contains(&PathBuf::from("util/c.rs")));
    assert_eq!(
        forbidden(&srcs, &doc),
        ["util/a.rs (util) imports run/b.rs (run)"]
    );
    // io and data stand side by side: neither imports the other, nor config io.
    let side = planted(&[
        ("data/x.rs", "use crate::io::y::Y;"),
        ("io/y.rs", "fn g() { crate::data::x::f(); }"),
        ("config/z.rs", "use crate::io::y;"),
        ("io/mod.rs", "pub mod y;"),
        ("data/mod.rs", "pub mod x;"),
        ("config/mod.rs", "pub mod z;"),
    ]);
    assert_eq!(
        forbidden(&side, &doc),
        [
            "config/z.rs (config) imports io/y.rs (io)",
            "data/x.rs (data) imports io/y.rs (io)",
            "io/y.rs (io) imports data/x.rs (data)"
        ]
    );
    // Test code is what #[cfg(test)] marks, not a file's name: a production `tests.rs` is read,
    // a module declared under #[cfg(test)] is not, whatever its name.
    let named = planted(&[
        (
            "util/mod.rs",
            "pub mod tests;\n#[cfg(test)]\n#[allow(unused)]\nmod checks;",
        ),
        ("util/tests.rs", "use crate::run::b::B;"),
        ("util/checks.rs", "use crate::run::b::B;"),
        ("run/mod.rs", "pub mod b;"),
        ("run/b.rs", ""),
    ]);
    assert_eq!(
        forbidden(&named, &doc),
        ["util/tests.rs (util) imports run/b.rs (run)"]
    );
    // A multi-line string holding `{` inside a test module, and a raw string with `}` and a
    // quote: the code after them is read.
    let strings = planted(&[
        (
            "util/mod.rs",
            "pub mod s;\n#[cfg(test)]\nmod tests {\n    const T: &str = \"a {\n b\";\n}\n\
             const R: &str = r#\"}\" }\"#;\nuse crate::run::b::B;",
        ),
        ("util/s.rs", ""),
        ("run/mod.rs", "pub mod b;"),
        ("run/b.rs", ""),
    ]);
    assert_eq!(
        forbidden(&strings, &doc),
        ["util/mod.rs (util) imports run/b.rs (run)"]
    );
    assert_eq!(
        without_tests(&blank_literals(
            "a\n#[cfg(test)]\nmod t { fn f() {\n}\n}\nb"
        )),
        "a\nb"
    );
    // A re-export reads what it shows.
    let shown = planted(&[
        ("util/mod.rs", "pub(crate) use crate::run::b::Thing;"),
        ("run/b.rs", ""),
    ]);
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
