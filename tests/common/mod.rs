//! Helpers shared by the integration tests (each test file is its own crate and uses some).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The binary under test.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_attnsweep"))
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
