//! attnsweep: sweeps of attention-sparsity experiments. See README.md for the tour.

pub mod cli;
pub mod config;
pub mod data;
pub mod io;
pub mod model;
pub mod run;
pub mod sweep;
pub mod util;
