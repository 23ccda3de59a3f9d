//! Sweeps: a grid file expands into cells, each a run with its own directory
//! (`<out>/<cell id>/`) holding its resolved config, log, checkpoints, evaluation and status.
//!
//! A grid file is TOML:
//!
//! ```toml
//! name = "demo"                     # results go to results/<name> unless --out says otherwise
//! seeds = 3                         # optional: every train cell over 3 seeds (train.seed, +1, +2);
//!                                   #   plot writes replicates.csv, replicate_differences.csv
//!                                   #   and stage_differences.csv
//! [synth]                           # optional: generate the synthetic corpus at base.data.dir
//! train_tokens = 300000             #   when no data set is there (fields of `data synth`)
//! # or [corpus]: prepare a text corpus there instead (fields of `data prepare`), e.g.
//! # python_package = "torch", glob = ["*.py"]
//! # and [probes] (fields of `data probes`): probe documents at base.data.dir, mixed into
//! # that corpus, which then goes to probes.mix_with
//! [base]                            # an experiment config ([base.model], [base.train], ...)
//! data.dir = "runs/demo/data"
//! [[stage]]                         # stages run in order, each in the earliest wave after every
//!                                   #   cell it waits for whose cells it places alike (train or
//!                                   #   not, neither exclusive); `--emit slurm` runs them apart
//! name = "base"
//! set = { "attention.method" = "full" }
//! [[stage]]
//! name = "aha"
//! init_from = "base"                # continue from the matching cell of an earlier stage
//! set = { "attention.method" = "aha" }
//! axes = { "attention.window" = [4, 8, 16] }    # cartesian product
//! zip = { "attention.lambda" = [1e-3, 1e-2], "train.lr" = [1e-3, 2e-3] }  # advanced together
//! include = [{ "attention.window" = 64 }]       # extra cells
//! exclude = [{ "attention.window" = 16, "attention.lambda" = 1e-2 }]
//! [[stage]]
//! name = "tau"
//! kind = "eval"                     # evaluate each cell of stage `of` with the overrides
//! of = "l2a"
//! axes = { "attention.tau" = [0.3, 0.5, 0.7] }
//! [[stage]]
//! name = "prune"
//! kind = "prune"                    # L2A pruning of each cell of stage `of`
//! of = "l2a"
//! thresholds = [0.9, 0.95]
//! ```
//!
//! In string settings, `{source}` stands for the directory of the cell a cell starts from,
//! and `{reads}` for that of the cell named by the stage's `reads` (a train stage's second
//! dependency, whose files it reads without taking its weights), e.g. static heads trained
//! from the base with `reads = "aha"` and `"attention.head_ranking" =
//! "{reads}/eval/head_ranking.csv"` (eval and prune stages act on a cell whose config holds
//! them resolved, and may not set one of their own). A train stage with `reads` and Bernoulli gates may set
//! `match_usage = true`: its gates then open at the usage (mu_f) the read cell's evaluation
//! measured, which is only known once that cell has run (gates at random against learned
//! ones at equal sparsity).
//!
//! A cell's id is its stage name plus a hash of what it computes (resolved config with the
//! settings its method ignores set aside, the cells it starts from and reads, its kind), so it
//! does not depend on how the grid file orders its keys, an edited grid reuses every cell whose
//! computation did not change, and a stage that computes what an earlier one did shares that
//! cell (same id and directory) instead of running it twice. A stage that expands to no cells
//! is an error. A cell depends on the one cell of the referenced stage whose settings agree
//! with its own on every key both set.
//!
//! Runners coordinate through the file system: a cell is run under an exclusive lock on
//! `<cell>/lock` (released by the OS when a runner dies), its state is `<cell>/status.json`
//! (written atomically), so re-running a sweep skips finished cells, resumes interrupted ones
//! and reruns failed ones only with `--retry-failed`.

mod axes;
mod budget;
mod cell_files;
mod check;
mod equal_work;
mod figure;
mod figures;
#[cfg(test)]
mod fixture;
mod grid;
pub(crate) mod pareto;
mod plan;
mod replicates;
mod retrain;
mod rows;
mod runner;
mod slurm;
mod status;
pub(crate) mod tables;

pub(crate) use tables::unread_report;

pub(crate) use check::{describe, problems};
pub(crate) use figure::{Figure, Look, Panel, Series, XAxis};
pub(crate) use figures::write_all;
pub(crate) use grid::StageKind;
pub use grid::{expand, read_grid, Cell, Grid};
pub(crate) use plan::plan;
pub(crate) use runner::{failed_cells, run, SweepArgs};
pub(crate) use slurm::emit_slurm;
pub(crate) use status::read_status;

/// `(cell, why)` pairs gathered by reason, in the order the reasons first come: each reason
/// with its cells written out, at most `most` named (`a, b, c and 4 more`).
fn by_reason<'a>(
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    most: usize,
) -> Vec<(&'a str, String)> {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for (cell, why) in pairs {
        match groups.iter_mut().find(|(w, _)| *w == why) {
            Some((_, cells)) => cells.push(cell),
            None => groups.push((why, vec![cell])),
        }
    }
    groups
        .into_iter()
        .map(|(why, cells)| {
            let more = match cells.len() > most {
                true => format!(" and {} more", cells.len() - most),
                false => String::new(),
            };
            let named: Vec<&str> = cells.into_iter().take(most).collect();
            (why, format!("{}{more}", named.join(", ")))
        })
        .collect()
}
