//! Progress of a long command: a bar on a terminal; where stderr is not one (a Slurm log, a
//! `nohup` file, a pipe), one plain status line every few seconds instead, since a bar's
//! redraws would either vanish or fill the log.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Seconds between status lines when stderr is not a terminal, unless a command's
/// `--status-every` says otherwise.
pub(crate) const DEFAULT_STATUS_EVERY: u64 = 30;

pub(crate) struct Progress {
    bar: ProgressBar,
    lines: Option<Lines>,
}

struct Lines {
    label: String,
    every: Duration,
    last: Instant,
    start: Instant,
    /// Position when the clock started (a resumed run starts part-way).
    first: u64,
    len: u64,
}

impl Progress {
    /// Progress over `len` units named by `label` (e.g. "steps"); nothing at all when `quiet`.
    /// `every` is the interval of status lines where stderr is not a terminal.
    pub(crate) fn new(len: u64, label: &str, quiet: bool, every: Duration) -> Progress {
        let terminal = std::io::stderr().is_terminal();
        let bar = if quiet || !terminal {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(len)
        };
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{{bar:30}} {{pos}}/{{len}} {label} {{msg}} [{{elapsed_precise}}<{{eta_precise}}]"
            ))
            .expect("template"),
        );
        let lines = (!quiet && !terminal).then(|| Lines {
            label: label.to_string(),
            every,
            last: Instant::now(),
            start: Instant::now(),
            first: 0,
            len,
        });
        Progress { bar, lines }
    }

    /// Where counting starts (a resumed run's first step), without a status line.
    pub(crate) fn start_at(&mut self, pos: u64) {
        self.bar.set_position(pos);
        if let Some(l) = &mut self.lines {
            l.first = pos;
        }
    }

    /// Moves to `pos` with `msg` (e.g. "loss 2.31 5400 tok/s"); where stderr is not a
    /// terminal, prints `pos/len label msg, elapsed, ETA` once `every` has passed since the
    /// last line.
    pub(crate) fn update(&mut self, pos: u64, msg: &str) {
        self.bar.set_position(pos);
        self.bar.set_message(msg.to_string());
        let Some(l) = &mut self.lines else { return };
        if l.last.elapsed() < l.every {
            return;
        }
        l.last = Instant::now();
        let elapsed = l.start.elapsed().as_secs_f64();
        let done = pos.saturating_sub(l.first);
        let eta = match done {
            0 => "?".to_string(),
            d => clock(elapsed / d as f64 * l.len.saturating_sub(pos) as f64),
        };
        eprintln!(
            "{pos}/{} {} {msg} [{} elapsed, ETA {eta}]",
            l.len,
            l.label,
            clock(elapsed)
        );
    }

    /// A line above the bar (or in the log).
    pub(crate) fn println(&self, line: &str) {
        if self.bar.is_hidden() {
            if self.lines.is_some() {
                eprintln!("{line}");
            }
        } else {
            self.bar.println(line);
        }
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Progress over units done one at a time where only a shared reference reaches the work (the
/// tensors of a file written lazily, each converted when the writer asks for its bytes).
pub(crate) struct Ticks {
    progress: std::cell::RefCell<Progress>,
    done: std::cell::Cell<u64>,
}

impl Ticks {
    /// `len` units named `label`, shown as `Progress` shows them (status lines in a log).
    pub(crate) fn new(len: u64, label: &str) -> Ticks {
        let every = Duration::from_secs(DEFAULT_STATUS_EVERY);
        Ticks {
            progress: std::cell::RefCell::new(Progress::new(len, label, false, every)),
            done: std::cell::Cell::new(0),
        }
    }

    /// One more unit done.
    pub(crate) fn tick(&self) {
        self.done.set(self.done.get() + 1);
        self.progress.borrow_mut().update(self.done.get(), "");
    }

    pub(crate) fn finish(&self) {
        self.progress.borrow().finish();
    }
}

/// `h:mm:ss`.
fn clock(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    #[test]
    fn clock_reads_hours_minutes_seconds() {
        assert_eq!(super::clock(0.4), "0:00:00");
        assert_eq!(super::clock(3725.0), "1:02:05");
    }
}
