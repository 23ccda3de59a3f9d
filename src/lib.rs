//! attnsweep: sweeps of attention-sparsity experiments. See README.md for the tour.

pub mod util;
pub mod io;
pub mod data;
pub mod config;
pub mod model;
pub mod run;
pub mod sweep;
pub mod cli;

