//! Child processes tied to the one that started them: a sweep's cells and a training run's
//! ranks. Killing a sweep (SIGTERM from a scheduler, a lost shell) would otherwise leave its
//! cells training on, orphaned, holding their GPUs while a restarted sweep waits on their
//! locks; tied, each is asked to stop (SIGTERM) when the thread that started and waits on it
//! ends, and what it wrote is whole (every file is written atomically) for the resume.

use std::os::raw::{c_int, c_ulong};
use std::process::Command;

const SIGTERM: c_int = 15;

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: c_int, sig: c_int) -> c_int;
    // Variadic in C, as declared here.
    #[cfg(target_os = "linux")]
    #[link_name = "prctl"]
    fn libc_prctl(option: c_int, ...) -> c_int;
}

/// Asks process `pid` to stop (SIGTERM): it ends as a killed one does.
pub(crate) fn terminate(pid: u32) {
    // SAFETY: kill(2) with a pid this process started and a valid signal number.
    unsafe {
        libc_kill(pid as c_int, SIGTERM);
    }
}

/// Makes the child `cmd` starts receive SIGTERM when the thread that starts it ends (Linux's
/// parent-death signal; elsewhere nothing changes). The thread must wait on the child, as the
/// sweep's workers and the rank launcher do: the signal follows the thread, not the process.
pub(crate) fn tie_to_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        const PR_SET_PDEATHSIG: c_int = 1;
        let parent = std::process::id();
        // SAFETY: the closure runs in the forked child before exec and calls only prctl(2)
        // and getppid(2), both async-signal-safe; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc_prctl(PR_SET_PDEATHSIG, SIGTERM as c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have ended between fork and prctl: then no signal comes.
                if std::os::unix::process::parent_id() != parent {
                    // ESRCH, with nothing allocated in the forked child.
                    return Err(std::io::Error::from_raw_os_error(3));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A tied child outlives neither the thread that started it: `sleep 60` started by a
    /// thread that then ends is stopped by SIGTERM within seconds, while an untied one
    /// started the same way still runs.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_tied_child_ends_with_the_thread_that_started_it() {
        use std::os::unix::process::ExitStatusExt;
        let start = |tie: bool| {
            std::thread::spawn(move || {
                let mut cmd = Command::new("sleep");
                cmd.arg("60");
                if tie {
                    tie_to_parent(&mut cmd);
                }
                cmd.spawn().unwrap()
            })
            .join()
            .unwrap()
        };
        let (mut tied, mut free) = (start(true), start(false));
        let until = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = tied.try_wait().unwrap() {
                break Some(s);
            }
            if Instant::now() > until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let still_running = free.try_wait().unwrap().is_none();
        for c in [&mut tied, &mut free] {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert_eq!(status.and_then(|s| s.signal()), Some(SIGTERM));
        assert!(still_running);
    }
}
