//! Crash-safe file output: every file is written beside its destination under a temporary
//! name and renamed into place, so a reader sees either the old complete file or the new
//! complete file, never a half-written one.

use crate::util::fault;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A temporary sibling of `path`, unique to this process, keeping the extension (the
/// safetensors writer picks its format by extension).
pub(crate) fn temp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".tmp-{}-{}", std::process::id(), name))
}

/// Runs `write` against a temporary path, fsyncs it, then renames it over `path`.
pub(crate) fn write_with<F>(path: &Path, write: F) -> Result<()>
where
    F: FnOnce(&Path) -> Result<()>,
{
    let tmp = temp_sibling(path);
    let result = write(&tmp).and_then(|()| {
        fault::write_error().with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("writing {}", path.display()))
}

/// A CSV of `header` and `rows`, written whole or not at all.
pub(crate) fn write_csv<H: AsRef<[u8]>>(
    path: &Path,
    header: &[H],
    rows: &[Vec<String>],
) -> Result<()> {
    write_with(path, |tmp| {
        let mut w = csv::Writer::from_path(tmp)?;
        w.write_record(header)?;
        for r in rows {
            w.write_record(r)?;
        }
        Ok(w.flush()?)
    })
}

pub(crate) fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |tmp| Ok(std::fs::write(tmp, bytes)?))
}

/// Creates `dir` (and parents) and proves it is writable by creating and removing a probe
/// file, so a run fails before it computes anything rather than at its first save.
pub(crate) fn ensure_writable_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create output directory {}", dir.display()))?;
    let probe = dir.join(format!(".probe-{}", std::process::id()));
    fault::write_error()
        .and_then(|()| std::fs::write(&probe, b""))
        .with_context(|| format!("output directory {} is not writable", dir.display()))?;
    std::fs::remove_file(&probe).ok();
    Ok(())
}

/// Removes the temporary files (`temp_sibling`) that writers killed mid-write left in `dir`:
/// those of processes that no longer run.
pub(crate) fn remove_stale_temporaries(dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(".tmp-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let path = e.path();
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// Creates (or truncates) the file `path` that a lock or a log lives in, an error naming it.
pub(crate) fn create_file(path: &Path) -> Result<std::fs::File> {
    fault::write_error()
        .and_then(|()| std::fs::File::create(path))
        .with_context(|| format!("cannot create {}", path.display()))
}

/// Takes the lock on `path` (created if missing) for as long as the returned file lives, or
/// `None` while another process holds it. The OS releases it when the process dies.
pub(crate) fn lock_file(path: &Path) -> Result<Option<std::fs::File>> {
    let file = create_file(path)?;
    // A child this process spawns (a compiler, a worker) holds a copy of the descriptor between
    // its fork and exec, so a lock just released can look held for a moment: one still held
    // after a second belongs to another process.
    for _ in 0..20 {
        if file.try_lock().is_ok() {
            return Ok(Some(file));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a killed writer left is removed; a running writer's temporary stays.
    #[test]
    fn temporaries_of_dead_writers_are_removed() {
        let dir = crate::util::scratch_dir("stale-temps");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = dir.join(format!(".tmp-{dead}-train_000000.bin"));
        let live = temp_sibling(&dir.join("val_000000.bin"));
        let kept = dir.join("train_000000.bin");
        for p in [&stale, &live, &kept] {
            std::fs::write(p, b"x").unwrap();
        }
        remove_stale_temporaries(&dir).unwrap();
        assert!(!stale.exists() && live.exists() && kept.exists());
    }

    #[test]
    fn failed_write_keeps_old_file_and_leaves_no_temp() {
        let dir = std::env::temp_dir().join(format!("attnsweep-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.txt");
        write_bytes(&path, b"old").unwrap();
        let err = write_with(&path, |tmp| {
            std::fs::write(tmp, b"half")?;
            anyhow::bail!("disk full")
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(leftovers.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
