//! Helpers shared by the integration tests (each test file is its own crate and uses some).
#![allow(dead_code)]

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_attnsweep"))
}

/// One command line of the binary, built in order from words (`"train -q"`, split at
/// whitespace), flags with a path or another value, `--set` overrides and bare arguments, then
/// run expecting success (`ok`), failure (`fails`) or either (`run`).
pub struct Cli(Vec<OsString>);

/// The command line starting with `words`.
pub fn cli(words: &str) -> Cli {
    Cli(Vec::new()).words(words)
}

impl Cli {
    /// More words, split at whitespace.
    pub fn words(mut self, words: &str) -> Self {
        self.0.extend(words.split_whitespace().map(OsString::from));
        self
    }

    /// `flag value`, the value taken as the OS holds it (a path need not be UTF-8).
    pub fn flag(mut self, flag: &str, value: impl AsRef<OsStr>) -> Self {
        self.0.push(flag.into());
        self.0.push(value.as_ref().to_os_string());
        self
    }

    /// `--set key=value` for each setting.
    pub fn set<S: AsRef<str>>(mut self, settings: impl IntoIterator<Item = S>) -> Self {
        for s in settings {
            self.0.push("--set".into());
            self.0.push(s.as_ref().into());
        }
        self
    }

    /// One argument as it is (a value with spaces, a path).
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.0.push(a.as_ref().to_os_string());
        self
    }

    /// Runs it, whatever it returns.
    pub fn run(&self) -> Output {
        bin().args(&self.0).output().expect("the binary runs")
    }

    /// Runs it; it must succeed.
    pub fn ok(&self) -> Output {
        let o = self.run();
        assert!(
            o.status.success(),
            "{:?} failed:\n{}",
            self.0,
            String::from_utf8_lossy(&o.stderr)
        );
        o
    }

    /// Runs it; it must fail. Returns its stderr.
    pub fn fails(&self) -> String {
        let o = self.run();
        assert!(!o.status.success(), "{:?} unexpectedly succeeded", self.0);
        String::from_utf8_lossy(&o.stderr).into_owned()
    }
}

/// An empty directory of this test process: `suite` names the test file, `name` the test.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("attnsweep-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A synthetic corpus of `train_tokens` in `dir/data`; returns the `data.dir=` setting.
pub fn synth(dir: &Path, train_tokens: usize) -> String {
    let data = dir.join("data");
    let o = bin()
        .args([
            "data",
            "synth",
            "--out",
            data.to_str().unwrap(),
            "--train-tokens",
        ])
        .arg(train_tokens.to_string())
        .args(["--val-tokens", "4096", "--max-distance", "64"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    format!("data.dir={}", data.display())
}

/// A byte-level text data set (one sentence repeated) in `dir/text-data`, which probes can
/// read; returns its folder.
pub fn text_data(dir: &Path) -> PathBuf {
    let text = dir.join("text.txt");
    std::fs::write(&text, "the cat sat on the mat. ".repeat(2000)).unwrap();
    let data = dir.join("text-data");
    let o = bin()
        .args(["data", "prepare", "--input"])
        .arg(&text)
        .arg("--out")
        .arg(&data)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    data
}

/// The `[base]` tables of a tiny CPU grid (2 layers of width 32, 3 steps) on the corpus at `data`.
pub fn tiny_base(data: &Path) -> String {
    format!(
        r#"
[base.data]
dir = "{data}"
seq_len = 64
[base.model]
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
[base.train]
steps = 3
warmup_steps = 1
batch_size = 4
log_every = 1
device = "cpu"
[base.eval]
max_batches = 2
"#,
        data = data.display()
    )
}

/// A tiny grid in `dir/grid.toml`: a full-attention base on a synthetic corpus, continued as AHA
/// at windows 4 and 8 (with `aha_set`, more `key = value` settings of that stage, if not empty),
/// with `extra` stages appended.
pub fn tiny_grid(dir: &Path, aha_set: &str, extra: &str) -> PathBuf {
    let aha_set = if aha_set.is_empty() {
        String::new()
    } else {
        format!(", {aha_set}")
    };
    let g = dir.join("grid.toml");
    let text = format!(
        r#"
name = "tiny"
[synth]
train_tokens = 20000
val_tokens = 4096
max_distance = 64
{base}
[[stage]]
name = "base"
set = {{ "attention.method" = "full" }}
[[stage]]
name = "aha"
init_from = "base"
set = {{ "attention.method" = "aha"{aha_set} }}
axes = {{ "attention.window" = [4, 8] }}
{extra}
"#,
        base = tiny_base(&dir.join("data"))
    );
    std::fs::write(&g, text).unwrap();
    g
}

/// The sweep's tables (CSV files at its top) with the columns and rows of measured time left
/// out, which differ between any two runs.
pub fn tables(out: &Path) -> Vec<(String, Vec<String>)> {
    let timed = |h: &str| {
        h.contains("tokens_per_s")
            || h.ends_with("_ms")
            || h.contains("per_mtok")
            || h.contains("front_time")
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "csv"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no tables in {}", out.display());
    files
        .iter()
        .map(|f| {
            let mut r = csv::Reader::from_path(f).unwrap();
            let head: Vec<String> = r.headers().unwrap().iter().map(String::from).collect();
            let keep: Vec<usize> = (0..head.len()).filter(|&i| !timed(&head[i])).collect();
            let metric = head.iter().position(|h| h == "metric");
            let mut rows = vec![keep
                .iter()
                .map(|&i| head[i].clone())
                .collect::<Vec<_>>()
                .join(",")];
            for rec in r.records() {
                let rec = rec.unwrap();
                // tidy.csv holds one metric a row.
                if metric.is_some_and(|m| timed(&rec[m])) {
                    continue;
                }
                rows.push(
                    keep.iter()
                        .map(|&i| rec[i].to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                );
            }
            (f.file_name().unwrap().to_string_lossy().into_owned(), rows)
        })
        .collect()
}

/// The probe samples an evaluation wrote into `eval` (`probe_samples.jsonl.gz`), as text.
pub fn probe_samples(eval: &Path) -> String {
    let file = std::fs::File::open(eval.join("probe_samples.jsonl.gz")).unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(file), &mut text).unwrap();
    text
}
