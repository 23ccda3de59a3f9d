//! What a grid's train cells still to run cost in GPU time, at the throughput its finished
//! cells measured: the dry run's plan, so that the cells of a device session are chosen to fit
//! it before anything runs.

use super::cell_files::Log;
use super::grid::{Cell, StageKind};
use crate::config::name_of;
use crate::util::stats::median;
use std::collections::BTreeMap;
use std::path::Path;

/// A method at a sequence length: the cells of one are taken to train at one rate.
type Kind = (String, usize);

fn kind(c: &Cell) -> Kind {
    (name_of(c.config.attention.method), c.config.data.seq_len)
}

/// Per kind, the median over its finished train cells (`done`, a flag per cell) of each one's
/// rate, its `train_log.csv`'s median tokens/s (`Log::median_rate`, the rate the tables
/// report): as those cells ran, on the GPUs each had.
fn measured_rates(out: &Path, cells: &[Cell], done: &[bool]) -> BTreeMap<Kind, f64> {
    let mut rates: BTreeMap<Kind, Vec<f64>> = BTreeMap::new();
    let finished = cells
        .iter()
        .zip(done)
        .filter(|(c, &d)| d && c.kind == StageKind::Train);
    for (c, _) in finished {
        let (Some(log), _) = Log::read(&out.join(&c.id).join("train_log.csv")) else {
            continue;
        };
        if let Some(rate) = log.median_rate().filter(|r| *r > 0.0) {
            rates.entry(kind(c)).or_default().push(rate);
        }
    }
    rates.into_iter().map(|(k, v)| (k, median(v))).collect()
}

/// The train cells to run (those of `picked`, where it names any, else every one) that have
/// not finished (`done`: a flag per cell, as the dry run read their states), and what they
/// cost at the measured rates.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Plan {
    pub(crate) cells: usize,
    pub(crate) tokens: f64,
    /// Of the cells whose kind has a measured rate: how many, and their seconds of training.
    pub(crate) timed: usize,
    pub(crate) seconds: f64,
    /// The kinds no finished cell has measured yet ("aha at 2048").
    pub(crate) unmeasured: Vec<String>,
}

pub(crate) fn plan(out: &Path, cells: &[Cell], done: &[bool], picked: &[usize]) -> Plan {
    let rates = measured_rates(out, cells, done);
    let mut p = Plan::default();
    let to_run = cells.iter().zip(done).filter(|(c, &d)| {
        !d && c.kind == StageKind::Train && (picked.is_empty() || picked.contains(&c.index))
    });
    for (c, _) in to_run {
        let tokens = c.train_tokens() as f64;
        p.cells += 1;
        p.tokens += tokens;
        match rates.get(&kind(c)) {
            Some(rate) => {
                p.timed += 1;
                p.seconds += tokens / rate;
            }
            None => {
                let (method, len) = kind(c);
                let name = format!("{method} at {len}");
                if !p.unmeasured.contains(&name) {
                    p.unmeasured.push(name);
                }
            }
        }
    }
    p
}

impl Plan {
    /// One line for the dry run.
    pub(crate) fn describe(&self) -> String {
        if self.cells == 0 {
            return "to run: no train cells".into();
        }
        let mut line = format!(
            "to run: {} train cells, {:.1}M tokens",
            self.cells,
            self.tokens / 1e6
        );
        if self.timed > 0 {
            line += &format!(
                "; at the rates this grid's finished cells of the same method and length \
                 measured (each its log's median, as it ran), about {:.0} minutes of training for {} of them, \
                 their starts and evaluations besides",
                self.seconds / 60.0,
                self.timed
            );
        }
        if !self.unmeasured.is_empty() {
            line += &format!("; no rate measured yet for {}", self.unmeasured.join(", "));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::grid::{expand, Grid};

    /// A finished cell's logged rate times the tokens of the cells of its kind still to run;
    /// a kind no finished cell measured is named; `--cell` narrows the cells counted.
    #[test]
    fn pending_cells_cost_their_kinds_measured_rate() {
        let grid: Grid = toml::from_str(
            r#"
name = "t"
seeds = 2
[base.data]
dir = "/tmp/none"
seq_len = 128
[base.train]
steps = 10
warmup_steps = 1
batch_size = 4
grad_accum = 2
[[stage]]
name = "full"
set = { "attention.method" = "full" }
[[stage]]
name = "swa"
set = { "attention.method" = "swa", "attention.window" = 32 }
"#,
        )
        .unwrap();
        let cells = expand(&grid).unwrap();
        assert_eq!(cells.len(), 4);
        let out = crate::util::scratch_dir("sweep-plan");
        // The first full-attention cell logged 100 tokens/s while warming up, then 480 and
        // 512: its rate is the median, 480; the cell of the other seed waits.
        let done = out.join(&cells[0].id);
        std::fs::create_dir_all(&done).unwrap();
        std::fs::write(
            done.join("train_log.csv"),
            "step,loss,tokens_per_s\n3,2.1,100\n6,2.0,480\n10,1.9,512\n",
        )
        .unwrap();
        let finished = [true, false, false, false];
        let p = plan(&out, &cells, &finished, &[]);
        // 10 steps x 4 x 2 sequences x 128 tokens = 10,240 tokens a cell, three to run.
        assert_eq!((p.cells, p.tokens, p.timed), (3, 3.0 * 10240.0, 1));
        assert!((p.seconds - 10240.0 / 480.0).abs() < 1e-9, "{}", p.seconds);
        assert_eq!(p.unmeasured, vec!["swa at 128".to_string()]);
        let line = p.describe();
        assert!(
            line.starts_with("to run: 3 train cells, 0.0M tokens"),
            "{line}"
        );
        assert!(
            line.contains("for 1 of them") && line.contains("swa at 128"),
            "{line}"
        );
        // Only the SWA cells picked: none timed.
        let p = plan(&out, &cells, &finished, &[2, 3]);
        assert_eq!((p.cells, p.timed), (2, 0));
        assert_eq!(
            plan(&out, &cells, &finished, &[0]).describe(),
            "to run: no train cells"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}
