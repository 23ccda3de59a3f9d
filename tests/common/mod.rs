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
