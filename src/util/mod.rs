//! The bottom layer: helpers with no knowledge of models or experiments.

pub(crate) mod atomic;
pub mod fault;
pub(crate) mod flags;
pub(crate) mod progress;
pub mod rng;
pub(crate) mod stats;

/// A fresh, empty directory of this test process for a unit test named `tag`.
#[cfg(test)]
pub(crate) fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("attnsweep-unit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
