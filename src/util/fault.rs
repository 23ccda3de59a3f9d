//! Crash points and failing writes for the reliability tests. With
//! `ATTNSWEEP_CRASH_AT=<point>:<n>` in the environment the process dies at once (abort: no
//! unwinding, no flushing, like a power cut or an out-of-memory kill) the n-th time it passes
//! `point` (counting from 1); `<point>:<n>:panic` panics there instead, as a bug would, and
//! `<point>:<n>:alloc` as libtorch's failed allocations do through tch, so tests see that no
//! panic reaches the user, and `<point>:<n>:hang` stops there for good, as a stuck process
//! would. With `ATTNSWEEP_CRASH_RANK=<r>` beside it, only rank r of a data-parallel job (its
//! `RANK`) is struck. With `ATTNSWEEP_FAIL_WRITE=<n>` the n-th file write fails as on a full
//! disk. Without the variables a point costs a relaxed atomic load.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

static TARGET: OnceLock<Option<(String, usize, String)>> = OnceLock::new();
static PASSED: AtomicUsize = AtomicUsize::new(0);
static FAIL_AT: OnceLock<Option<usize>> = OnceLock::new();
static WRITES: AtomicUsize = AtomicUsize::new(0);

/// Called before each file write: the injected full-disk error, if this is the chosen write.
pub(crate) fn write_error() -> std::io::Result<()> {
    let at = FAIL_AT.get_or_init(|| std::env::var("ATTNSWEEP_FAIL_WRITE").ok()?.parse().ok());
    match at {
        Some(n) if WRITES.fetch_add(1, Ordering::Relaxed) + 1 == *n => Err(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "No space left on device (injected)",
        )),
        _ => Ok(()),
    }
}

/// Where a crash may be injected; the names are listed by `POINTS`.
pub(crate) fn point(name: &str) {
    let target = TARGET.get_or_init(|| {
        let v = std::env::var("ATTNSWEEP_CRASH_AT").ok()?;
        if let Ok(rank) = std::env::var("ATTNSWEEP_CRASH_RANK") {
            if std::env::var("RANK").ok() != Some(rank) {
                return None;
            }
        }
        let mut parts = v.split(':');
        let (p, n) = (parts.next()?, parts.next()?.parse().ok()?);
        Some((
            p.to_string(),
            n,
            parts.next().unwrap_or("abort").to_string(),
        ))
    });
    if let Some((p, n, how)) = target {
        if p == name && PASSED.fetch_add(1, Ordering::Relaxed) + 1 == *n {
            match how.as_str() {
                "panic" => panic!("injected panic at {name}"),
                // A real allocation libtorch refuses (128 TiB), failing as any would: a
                // panic out of tch carrying libtorch's message and C++ backtrace.
                "alloc" => {
                    let _ = tch::Tensor::empty([1i64 << 45], (tch::Kind::Float, tch::Device::Cpu));
                }
                "hang" => loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                },
                _ => std::process::abort(),
            }
        }
    }
}

/// Every crash point: inside a checkpoint write (after the model file, before the rename;
/// after the rename, before `latest`), after an optimizer step before its log row, after a
/// log row, between the files of an evaluation report, after a batch of probes reached the
/// evaluation's journal, and in a sweep runner after a cell's process finished but before its
/// status is written.
pub const POINTS: [&str; 7] = [
    "checkpoint_files",
    "checkpoint_renamed",
    "step_applied",
    "log_row",
    "eval_report",
    "probe_batch",
    "sweep_cell_finished",
];
