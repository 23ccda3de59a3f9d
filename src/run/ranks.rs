//! Data-parallel jobs: where this process stands in one (`Place`, from the variables a
//! launcher sets: torchrun's, Slurm's, or `launch`'s own), and `launch`, which starts the
//! ranks of `train --gpus N` on this machine and stops them all when one fails.
//!
//! The launcher passes its whole environment on to every rank and adds only the rank's place,
//! `OMP_NUM_THREADS` unless set (the machine's cores shared out between the ranks), and the
//! settings that keep NVLink multicast off (`NO_MULTICAST`, over any other value). A rank
//! started by torchrun or srun sets those itself before it joins the job.

use crate::model::kernels;
use crate::model::kernels::dist::{Dist, Rendezvous};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::ops::Range;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// This process as one rank of a job.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Place {
    pub(crate) rendezvous: Rendezvous,
    /// Its index among the ranks of its machine: the GPU it trains on.
    pub(crate) local: usize,
}

impl Place {
    /// The rank that writes the run's files (logs, checkpoints, evaluation).
    pub(crate) fn leads(&self) -> bool {
        self.rendezvous.rank == 0
    }
}

/// This process's place from `var` (the environment): torchrun's and `launch`'s `RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, else Slurm's `SLURM_PROCID`,
/// `SLURM_NTASKS`, `SLURM_LOCALID` with the job's `MASTER_ADDR` and `MASTER_PORT`. None for a
/// process alone (no such variables, or a world of one).
pub(crate) fn place_from(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Place>> {
    let (rank, world, local) = match (var("RANK"), var("WORLD_SIZE")) {
        (Some(r), Some(w)) => (r, w, var("LOCAL_RANK").unwrap_or_else(|| "0".into())),
        _ => match (var("SLURM_PROCID"), var("SLURM_NTASKS")) {
            (Some(r), Some(w)) => (r, w, var("SLURM_LOCALID").unwrap_or_else(|| "0".into())),
            _ => return Ok(None),
        },
    };
    let number = |what: &str, v: &str| -> Result<usize> {
        v.trim()
            .parse()
            .with_context(|| format!("{what} = {v:?} is not a whole number"))
    };
    let (rank, world, local) = (
        number("the rank", &rank)?,
        number("the world size", &world)?,
        number("the local rank", &local)?,
    );
    if world <= 1 {
        return Ok(None);
    }
    if rank >= world {
        bail!("rank {rank} of a world of {world}: the launcher's variables disagree");
    }
    let (Some(host), Some(port)) = (var("MASTER_ADDR"), var("MASTER_PORT")) else {
        bail!(
            "rank {rank} of {world} needs MASTER_ADDR and MASTER_PORT (where rank 0 serves the \
             rendezvous); a Slurm job sets them to its first node and a free port (sweep --emit \
             slurm writes them)"
        );
    };
    let port: u16 = port
        .trim()
        .parse()
        .with_context(|| format!("MASTER_PORT = {port:?} is not a TCP port"))?;
    Ok(Some(Place {
        rendezvous: Rendezvous {
            host,
            port,
            rank,
            world,
        },
        local,
    }))
}

/// A trainer's part in a data-parallel job: its membership, and the parameters (by name)
/// its reducer averages.
pub(crate) struct Team {
    dist: Dist,
    reduced: Vec<String>,
}

/// DDP's bucket sizes (torch's defaults): 1 MiB first, so the first all-reduce starts early in
/// the backward, then 25 MiB.
const FIRST_BUCKET: usize = 1 << 20;
const BUCKET: usize = 25 << 20;

/// NVLink multicast (NCCL's NVLS, torch's symmetric memory, NVSHMEM's) stays off: every rank
/// runs with these, whatever its environment said.
pub(crate) const NO_MULTICAST: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

impl Team {
    /// Joins the job from `device` (NCCL between GPUs, Gloo between CPU processes), with
    /// multicast off whatever a launcher other than ours set (before NCCL reads it).
    pub(crate) fn join(place: &Place, device: Device, timeout_s: f64) -> Result<Team> {
        for (k, v) in NO_MULTICAST {
            std::env::set_var(k, v);
        }
        let kern = match device {
            Device::Cuda(_) => kernels::cuda().context(
                "data-parallel training on GPUs needs the CUDA kernel library (attnsweep kernels \
                 build)",
            )?,
            _ => kernels::cpu()?,
        };
        let dist = Dist::join(
            kern,
            &place.rendezvous,
            device,
            Duration::from_secs_f64(timeout_s),
        )?;
        Ok(Team {
            dist,
            reduced: Vec::new(),
        })
    }

    /// Leaves the job once this rank's last collective is done.
    pub(crate) fn close(self) -> Result<()> {
        self.dist.close()
    }

    /// Rank 0's values of `params` on every rank (as DDP starts: one model, whatever each
    /// rank built or loaded).
    pub(crate) fn share(&self, params: &BTreeMap<String, Tensor>) -> Result<()> {
        let all: Vec<Tensor> = params.values().map(|p| p.shallow_clone()).collect();
        tch::no_grad(|| self.dist.broadcast(&all))
    }

    /// The reducer over the parameters of `params` that now take gradients (a held router
    /// takes none), built again when that set changes; in the order the forward uses them.
    pub(crate) fn reduce_over(&mut self, params: &BTreeMap<String, Tensor>) -> Result<()> {
        let mut names: Vec<&String> = params
            .iter()
            .filter(|(_, p)| p.requires_grad())
            .map(|(n, _)| n)
            .collect();
        names.sort_by_key(|n| forward_key(n));
        if names
            .iter()
            .map(|n| n.as_str())
            .eq(self.reduced.iter().map(|n| n.as_str()))
        {
            return Ok(());
        }
        let tensors: Vec<Tensor> = names.iter().map(|n| params[*n].shallow_clone()).collect();
        self.dist.reducer(&tensors, FIRST_BUCKET, BUCKET)?;
        self.reduced = names.into_iter().cloned().collect();
        Ok(())
    }

    /// The micro-batches of each step that are this rank's, of `accum`: a contiguous share, so
    /// the job's micro-batches are one process's in its order.
    pub(crate) fn mine(&self, accum: usize) -> Range<usize> {
        let each = accum / self.dist.world;
        self.dist.rank * each..(self.dist.rank + 1) * each
    }

    pub(crate) fn arm(&self) -> Result<()> {
        self.dist.arm()
    }

    pub(crate) fn finish(&self) -> Result<usize> {
        self.dist.finish()
    }

    /// `values` summed over the ranks.
    pub(crate) fn sum(&self, values: &[f64], device: Device) -> Result<Vec<f64>> {
        let t = Tensor::from_slice(values).to_device(device);
        self.dist.sum(&[t.shallow_clone()])?;
        Ok(Vec::<f64>::try_from(
            t.to_kind(Kind::Double).to_device(Device::Cpu),
        )?)
    }
}

/// A parameter name's place in the forward: the embedding, the blocks by number, then the
/// final norm and the head (numbers compared as numbers, so block 10 follows block 9).
fn forward_key(name: &str) -> (u8, Vec<(u64, String)>) {
    let stage = match name {
        n if n.contains("embed_tokens") => 0,
        n if n.contains(".layers.") => 1,
        n if n.starts_with("lm_head") => 3,
        _ => 2,
    };
    let parts = name
        .split('.')
        .map(|s| match s.parse::<u64>() {
            Ok(n) => (n, String::new()),
            Err(_) => (u64::MAX, s.to_string()),
        })
        .collect();
    (stage, parts)
}

/// This process's place in a job, from its environment.
pub(crate) fn place() -> Result<Option<Place>> {
    place_from(&|k| std::env::var(k).ok())
}

/// The device of the rank `local` of its machine under `train.device`: its own GPU (the
/// local rank's), or the CPU.
pub(crate) fn device_of(spec: &str, local: usize) -> Result<Device> {
    let gpus = tch::Cuda::device_count() as usize;
    match crate::config::parse_device(spec)? {
        crate::config::DeviceSpec::Cpu => Ok(Device::Cpu),
        crate::config::DeviceSpec::Auto if gpus == 0 => Ok(Device::Cpu),
        _ => {
            anyhow::ensure!(
                local < gpus,
                "rank {local} of this machine trains on GPU {local}, but it has {gpus} GPUs: \
                 start at most {gpus} ranks a machine"
            );
            Ok(Device::Cuda(local))
        }
    }
}

/// A TCP port free on this machine now, for rank 0's store.
fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free TCP port")?;
    Ok(l.local_addr()?.port())
}

/// Starts `ranks` copies of this command on this machine, rank r on GPU r (or as CPU ranks),
/// each with its place in its environment, and waits for them. When one fails, the others
/// are stopped (what they wrote is whole: every file is written atomically) and the error
/// names the rank; its own message is above, on the shared standard error.
pub(crate) fn launch(ranks: usize) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find this program to start its ranks")?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let port = free_port()?;
    // The machine's cores shared out between the ranks (as torchrun does), unless set.
    let threads = std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / ranks).max(1).to_string()
    });
    let mut children: Vec<Child> = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let mut cmd = Command::new(&exe);
        // A killed launcher stops its ranks rather than leave them holding the GPUs.
        crate::util::process::tie_to_parent(&mut cmd);
        let child = cmd
            .args(&args)
            .envs(NO_MULTICAST)
            .env("OMP_NUM_THREADS", &threads)
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", ranks.to_string())
            .env("LOCAL_RANK", r.to_string())
            .env("LOCAL_WORLD_SIZE", ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                stop(&mut children);
                bail!("cannot start rank {r}: {e}");
            }
        }
    }
    wait_all(children)
}

/// Waits for every rank; the first to fail stops the others.
fn wait_all(mut children: Vec<Child>) -> Result<()> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        for (r, c) in children.iter_mut().enumerate() {
            if done[r].is_some() {
                continue;
            }
            if let Some(status) = c.try_wait()? {
                done[r] = Some(status);
                if !status.success() {
                    // Ranks still running had not reached the collective the failed one gave
                    // up on: a rank that hangs is named so.
                    let running: Vec<String> = (0..done.len())
                        .filter(|&k| done[k].is_none())
                        .map(|k| k.to_string())
                        .collect();
                    stop(&mut children);
                    let also = match running.is_empty() {
                        true => String::new(),
                        false => format!(
                            "; still running then, and stopped: rank {}",
                            running.join(", ")
                        ),
                    };
                    bail!(
                        "rank {r} of {} failed ({}){also}",
                        children.len(),
                        describe(status)
                    );
                }
            }
        }
        if done.iter().all(Option::is_some) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "no exit status".into(),
    }
}

/// Asks every rank still running to stop, then kills those that have not within 10 s.
fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            // The rank's process ends as a killed one does; its files are whole.
            crate::util::process::terminate(c.id());
        }
    }
    let until = Instant::now() + Duration::from_secs(10);
    for c in children.iter_mut() {
        while matches!(c.try_wait(), Ok(None)) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    /// Blocks in their order (10 after 9), between the embedding and the head.
    #[test]
    fn parameters_go_in_the_order_of_the_forward() {
        let mut names = vec![
            "lm_head.weight",
            "model.layers.10.mlp.up_proj.weight",
            "model.norm.weight",
            "model.layers.9.self_attn.q_proj.weight",
            "model.layers.9.mlp.up_proj.weight",
            "model.embed_tokens.weight",
        ];
        names.sort_by_key(|n| forward_key(n));
        assert_eq!(
            names,
            [
                "model.embed_tokens.weight",
                "model.layers.9.mlp.up_proj.weight",
                "model.layers.9.self_attn.q_proj.weight",
                "model.layers.10.mlp.up_proj.weight",
                "model.norm.weight",
                "lm_head.weight",
            ]
        );
    }

    /// torchrun's variables, Slurm's, a world of one, and what is missing or wrong.
    #[test]
    fn a_place_is_read_from_the_launchers_variables() {
        let torchrun = [
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ];
        let p = place_from(&env(&torchrun)).unwrap().unwrap();
        assert_eq!((p.rendezvous.rank, p.rendezvous.world, p.local), (3, 8, 1));
        assert_eq!(
            (p.rendezvous.host.as_str(), p.rendezvous.port),
            ("node0", 29500)
        );
        assert!(!p.leads());
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("MASTER_ADDR", "n1"),
            ("MASTER_PORT", "1234"),
        ];
        assert!(place_from(&env(&slurm)).unwrap().unwrap().leads());
        assert_eq!(
            place_from(&env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")])).unwrap(),
            None
        );
        assert_eq!(place_from(&env(&[])).unwrap(), None);
        let e = place_from(&env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR and MASTER_PORT"), "{e}");
        let e = place_from(&env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("disagree"), "{e}");
    }
}
