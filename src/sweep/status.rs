//! A cell's state on disk (`status.json` in its folder): what the runner writes as a cell
//! starts, finishes or fails, and what the tables, the dry run and `--cell` read.

use crate::util::atomic;
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum State {
    Running,
    Done,
    Failed,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(crate) struct Status {
    pub(crate) state: State,
    pub(crate) attempts: u32,
    pub(crate) error: Option<String>,
}

/// The state of the cell in `cell_dir`; None where it never started (no folder or no
/// readable status).
pub(crate) fn read_status(cell_dir: &Path) -> Option<Status> {
    std::fs::read_to_string(cell_dir.join("status.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
}

pub(crate) fn write_status(cell_dir: &Path, status: &Status) -> Result<()> {
    atomic::write_bytes(
        &cell_dir.join("status.json"),
        serde_json::to_string_pretty(status)?.as_bytes(),
    )
}
