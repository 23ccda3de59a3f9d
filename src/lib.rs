//! attnsweep: sweeps of attention-sparsity experiments. See README.md for the tour.

pub mod atomic;
pub mod attention;
pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod convert;
pub mod corpus;
pub mod data;
pub mod eval;
pub mod fault;
pub mod kernels;
pub mod memory;
pub mod model;
pub mod nn;
pub mod pareto;
pub mod pickle;
pub mod plot;
pub mod probes;
pub mod progress;
pub mod prune;
pub mod rng;
pub mod run;
pub mod sweep;
pub mod tables;
pub mod tasks;
pub mod train;

/// A fresh, empty directory of this test process for a unit test named `tag`.
#[cfg(test)]
pub(crate) fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("attnsweep-unit-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}
