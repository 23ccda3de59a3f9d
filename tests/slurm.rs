//! The job arrays `sweep --emit slurm` writes, run by a real single-node Slurm: munged,
//! slurmctld and slurmd started here with a private configuration on free ports. `submit.sh`
//! runs a tiny grid to completion; an array task cancelled while its cell trains is resumed
//! from the cell's checkpoint by submitting again (finished cells are skipped); both sweeps'
//! tables equal a local run of the same grid.
//!
//! Ignored by default: it needs Debian's `slurm-wlm` and `munge`. `make test` runs it where
//! their daemons are installed and says it was skipped otherwise.

mod common;
use common::{bin, scratch, tables, tiny_grid};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn ok(cmd: &mut Command) -> Output {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&ok(cmd).stdout).trim().to_string()
}

/// A TCP port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One node's Slurm and its munge daemon, stopped when dropped.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
}

impl Cluster {
    fn start(dir: &Path) -> Cluster {
        for d in ["munge", "state", "spool", "log"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let munge = dir.join("munge");
        // munged refuses a key or socket directory others can read.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&munge, std::fs::Permissions::from_mode(0o700)).unwrap();
        let key = munge.join("munge.key");
        ok(Command::new("mungekey").arg("-c").arg("-k").arg(&key));
        let socket = munge.join("socket");
        ok(Command::new("munged")
            .arg("--force")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!(
                "--log-file={}",
                dir.join("log/munged.log").display()
            ))
            .arg(format!("--pid-file={}", munge.join("pid").display()))
            .arg(format!("--seed-file={}", munge.join("seed").display())));
        let host = stdout(Command::new("hostname").arg("-s"));
        let user = stdout(Command::new("id").arg("-un"));
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let p = |name: &str| dir.join(name).display().to_string();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=attnsweep-test\nSlurmctldHost={host}\nSlurmUser={user}\nSlurmdUser={user}\n\
                 AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={socket}\n\
                 SlurmctldPort={ctld}\nSlurmdPort={d}\nStateSaveLocation={state}\nSlurmdSpoolDir={spool}\n\
                 SlurmctldPidFile={ctld_pid}\nSlurmdPidFile={d_pid}\n\
                 SlurmctldLogFile={ctld_log}\nSlurmdLogFile={d_log}\n\
                 ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
                 AccountingStorageType=accounting_storage/none\nSchedulerType=sched/builtin\n\
                 SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nMpiDefault=none\nReturnToService=2\n\
                 SlurmdParameters=config_overrides\n\
                 NodeName={host} CPUs={cpus} State=UNKNOWN\n\
                 PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP\n",
                socket = socket.display(),
                ctld = free_port(),
                d = free_port(),
                state = p("state"),
                spool = p("spool"),
                ctld_pid = p("slurmctld.pid"),
                d_pid = p("slurmd.pid"),
                ctld_log = p("log/slurmctld.log"),
                d_log = p("log/slurmd.log"),
            ),
        )
        .unwrap();
        let cluster = Cluster {
            dir: dir.to_path_buf(),
            conf,
        };
        ok(cluster.cmd("slurmctld").arg("-f").arg(&cluster.conf));
        ok(cluster.cmd("slurmd").arg("-f").arg(&cluster.conf));
        cluster.until("the node to come up idle", || {
            let o = cluster.cmd("sinfo").args(["-h", "-o", "%t"]).output();
            o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
        });
        cluster
    }

    /// A Slurm command (or the daemons) on this cluster's configuration.
    fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new(prog);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Polls `done` for up to five minutes, then fails with the daemons' logs.
    fn until(&self, what: &str, mut done: impl FnMut() -> bool) {
        let start = Instant::now();
        while !done() {
            if start.elapsed() > Duration::from_secs(300) {
                let log = |f: &str| {
                    std::fs::read_to_string(self.dir.join("log").join(f)).unwrap_or_default()
                };
                panic!(
                    "timed out waiting for {what}\nslurmctld:\n{}\nslurmd:\n{}",
                    log("slurmctld.log"),
                    log("slurmd.log")
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Waits until no job is pending or running.
    fn drain(&self) {
        self.until("the queue to empty", || {
            stdout(self.cmd("squeue").arg("-h")).is_empty()
        });
    }

    /// Runs a sweep's submit.sh; returns each stage's job id.
    fn submit(&self, out: &Path) -> Vec<(String, String)> {
        let printed = stdout(self.cmd("bash").arg(out.join("slurm/submit.sh")));
        printed
            .lines()
            .filter_map(|l| {
                let (stage, job) = l.strip_prefix("stage ")?.split_once(": job ")?;
                Some((stage.to_string(), job.to_string()))
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for pid in ["slurmd.pid", "slurmctld.pid", "munge/pid"] {
            if let Ok(pid) = std::fs::read_to_string(self.dir.join(pid)) {
                let _ = Command::new("kill").arg(pid.trim()).status();
            }
        }
    }
}

/// Each started cell's (state, attempts), by cell directory.
fn cells(out: &Path) -> BTreeMap<String, (String, u64)> {
    std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("status.json").is_file())
        .map(|p| {
            let text = std::fs::read_to_string(p.join("status.json")).unwrap();
            let s: serde_json::Value = serde_json::from_str(&text).unwrap();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                (
                    s["state"].as_str().unwrap_or("").to_string(),
                    s["attempts"].as_u64().unwrap_or(0),
                ),
            )
        })
        .collect()
}

#[test]
#[ignore = "needs a Slurm (Debian's slurm-wlm and munge); make test runs it where they are installed"]
fn slurm_arrays_run_a_grid_resume_a_cancelled_task_and_equal_a_local_run() {
    let d = scratch("slurm", "arrays");
    // AHA cells of 400 steps, a checkpoint every 10: long enough to cancel one while it trains.
    let grid = tiny_grid(&d, r#""train.steps" = 400, "train.ckpt_every" = 10"#, "");
    let cluster = Cluster::start(&d.join("cluster"));
    let sweep = |out: &Path, extra: &[&str]| {
        ok(bin()
            .arg("sweep")
            .arg("--grid")
            .arg(&grid)
            .arg("--out")
            .arg(out)
            .args(extra))
    };

    let local = d.join("local");
    sweep(&local, &[]);
    let want = tables(&local);

    // One submission runs every stage, each array waiting for the one before.
    let whole = d.join("whole");
    sweep(&whole, &["--emit", "slurm"]);
    let jobs = cluster.submit(&whole);
    assert_eq!(
        jobs.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(),
        ["base", "aha"]
    );
    cluster.drain();
    let done = cells(&whole);
    assert!(
        done.len() == 3 && done.values().all(|(s, a)| s == "done" && *a == 1),
        "{done:?}"
    );
    ok(bin().arg("plot").arg("--sweep").arg(&whole));
    assert_eq!(tables(&whole), want);

    // Cancel the second AHA cell's array task once it has written a checkpoint: the rest
    // finishes, that cell stays interrupted; submitting again resumes it from its checkpoint
    // and skips the cells already done.
    let resumed = d.join("resumed");
    sweep(&resumed, &["--emit", "slurm"]);
    let listed = stdout(
        bin()
            .arg("sweep")
            .arg("--grid")
            .arg(&grid)
            .arg("--out")
            .arg(&resumed)
            .arg("--dry-run"),
    );
    let cell = listed
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some("2")).then(|| f.next().unwrap().to_string())
        })
        .unwrap_or_else(|| panic!("no cell 2 in:\n{listed}"));
    let jobs = cluster.submit(&resumed);
    let latest = resumed.join(&cell).join("checkpoints/latest");
    cluster.until("cell 2's first checkpoint", || latest.exists());
    ok(cluster.cmd("scancel").arg(format!("{}_2", jobs[1].1)));
    cluster.drain();
    let cancelled = cells(&resumed);
    assert_eq!(
        cancelled.values().filter(|(s, _)| s == "done").count(),
        2,
        "{cancelled:?}"
    );
    assert_eq!(cancelled[&cell].0, "running", "{cancelled:?}");
    cluster.submit(&resumed);
    cluster.drain();
    let after = cells(&resumed);
    assert!(after.values().all(|(s, _)| s == "done"), "{after:?}");
    for (id, (_, attempts)) in &after {
        assert_eq!(*attempts, if *id == cell { 2 } else { 1 }, "{after:?}");
    }
    ok(bin().arg("plot").arg("--sweep").arg(&resumed));
    assert_eq!(tables(&resumed), want);
}

/// The ranks of a data-parallel job started by Slurm (`srun`, one task a rank, the job's
/// MASTER_ADDR and MASTER_PORT) train the model one process trains, bit for bit.
#[test]
#[ignore = "needs a Slurm (Debian's slurm-wlm and munge); make test runs it where they are installed"]
fn srun_starts_the_ranks_of_a_data_parallel_job() {
    let d = scratch("slurm", "ranks");
    let cluster = Cluster::start(&d.join("cluster"));
    let data = common::synth(&d, 6000);
    let sets: Vec<String> = [
        "model.hidden_size=16",
        "model.intermediate_size=32",
        "model.num_hidden_layers=1",
        "data.seq_len=32",
        "train.batch_size=2",
        "train.grad_accum=2",
        "train.steps=3",
        "train.warmup_steps=1",
        "train.device=cpu",
        "eval.max_batches=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([data])
    .collect();
    let set_args: Vec<&str> = sets.iter().flat_map(|s| ["--set", s.as_str()]).collect();
    let one = d.join("one");
    ok(bin()
        .args(["train", "-q", "--out"])
        .arg(&one)
        .args(&set_args));
    let two = d.join("two");
    ok(cluster
        .cmd("srun")
        .args(["-n", "2", "--kill-on-bad-exit=1"])
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", free_port().to_string())
        .arg(env!("CARGO_BIN_EXE_attnsweep"))
        .args(["train", "-q", "--out"])
        .arg(&two)
        .args(&set_args));
    let weights = |run: &Path| {
        let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
        let mut t = tch::Tensor::read_safetensors(
            run.join("checkpoints")
                .join(latest.trim())
                .join("model.safetensors"),
        )
        .unwrap();
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t
    };
    for ((n, a), (_, b)) in weights(&one).iter().zip(&weights(&two)) {
        assert!(a.equal(b), "{n} differs");
    }
    let config = std::fs::read_to_string(two.join("config.toml")).unwrap();
    assert!(config.contains("ranks = 2"), "{config}");
}
