//! The size guard beside the layer rules: no function of non-test code over 150 lines and no
//! file over 900 lines of non-test code (`source.rs` says what counts as test code). A file
//! or function past them is split along its seams, not let grow.

mod source;
use source::{code_lines, functions, read, sources};

use std::path::PathBuf;

const MAX_FUNCTION_LINES: usize = 150;
const MAX_FILE_LINES: usize = 900;

/// The functions over the limit, as `path:line name (lines)`.
fn long_functions(srcs: &[source::Source]) -> Vec<String> {
    let mut out = Vec::new();
    for s in srcs {
        for (name, line, n) in functions(&s.code) {
            if n > MAX_FUNCTION_LINES {
                out.push(format!("{}:{line} {name} ({n} lines)", s.path.display()));
            }
        }
    }
    out
}

/// The files over the limit, as `path (lines)`.
fn long_files(srcs: &[source::Source]) -> Vec<String> {
    code_lines(srcs)
        .into_iter()
        .filter(|(_, n)| *n > MAX_FILE_LINES)
        .map(|(p, n)| format!("{} ({n} lines)", p.display()))
        .collect()
}

#[test]
fn no_function_over_150_lines_and_no_file_over_900() {
    let srcs = sources();
    let (functions, files) = (long_functions(&srcs), long_files(&srcs));
    assert!(
        functions.is_empty() && files.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines: {functions:#?}\nfiles over {MAX_FILE_LINES} \
         lines of non-test code: {files:#?}"
    );
}

/// The guard measures what it says: a planted long function and a long file are reported,
/// their test code is not counted, and a function's braces inside strings do not end it.
#[test]
fn the_guard_sees_long_functions_and_files() {
    let body = |n: usize| "    let x = 1;\n".repeat(n);
    let long_fn = format!(
        "fn long() {{\n    let s = \"}}\";\n{}}}\nfn short() {{}}\n",
        body(MAX_FUNCTION_LINES)
    );
    let tests = format!(
        "#[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{}    }}\n}}\n",
        body(MAX_FILE_LINES)
    );
    let srcs = read(vec![
        (
            PathBuf::from("util/a.rs"),
            vec!["util".into(), "a".into()],
            long_fn,
        ),
        (
            PathBuf::from("util/b.rs"),
            vec!["util".into(), "b".into()],
            format!("fn f() {{}}\n{tests}"),
        ),
        (
            PathBuf::from("util/c.rs"),
            vec!["util".into(), "c".into()],
            "const X: u8 = 0;\n".repeat(MAX_FILE_LINES + 1),
        ),
    ]);
    assert_eq!(long_functions(&srcs), ["util/a.rs:1 long (153 lines)"]);
    assert_eq!(long_files(&srcs), ["util/c.rs (901 lines)"]);
}
