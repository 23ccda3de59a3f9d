//! Data-parallel training on the CPU: ranks started by `train --gpus N` with Gloo between
//! them, against one process training the same global batch (its micro-batches one rank's
//! each): the same weights bit for bit, a job resumed with another number of ranks, and a
//! rank that dies or hangs stopping the job with what it wrote kept whole.

mod common;
use common::{cli, synth, tables, tiny_base};

use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    common::scratch("ranks", name)
}

/// A tiny model, 4 steps of a global batch of 2 x 2 sequences, a checkpoint every 2 steps.
fn settings(data: &str) -> Vec<String> {
    [
        "model.hidden_size=16",
        "model.intermediate_size=32",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=2",
        "data.seq_len=32",
        "train.batch_size=2",
        "train.grad_accum=2",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.ckpt_every=2",
        "train.log_every=1",
        "train.device=cpu",
        "eval.max_batches=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([data.to_string()])
    .collect()
}

/// The weights of a run's latest checkpoint.
fn weights(run: &Path) -> Vec<(String, tch::Tensor)> {
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    let file = run
        .join("checkpoints")
        .join(latest.trim())
        .join("model.safetensors");
    let mut all = tch::Tensor::read_safetensors(file).unwrap();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

fn same_weights(a: &Path, b: &Path) {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    for ((n, x), (m, y)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        assert!(x.equal(y), "{n} differs");
    }
}

/// The training log without the columns that differ between runs (rate, peak memory).
fn log(run: &Path) -> Vec<String> {
    std::fs::read_to_string(run.join("train_log.csv"))
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            [&f[..4], &f[5..8]].concat().join(",")
        })
        .collect()
}

/// Two ranks, each one micro-batch of the global batch a step, give the weights and losses of
/// one process accumulating both, bit for bit, whatever the step does: the plain backward;
/// blocks recomputed and the loss in chunks (many backward passes a step); AHA's routers and
/// penalty; L2A's router held for the first steps (the reducer built again when it learns).
/// Only rank 0 writes.
#[test]
fn two_ranks_train_one_processs_model_bit_for_bit() {
    let dir = scratch("bitwise");
    let sets = settings(&synth(&dir, 6000));
    for (name, extra) in [
        ("plain", vec![]),
        (
            "staged",
            vec![
                "train.activation_checkpointing=full",
                "train.loss_chunk_tokens=16",
            ],
        ),
        ("aha", vec!["attention.method=aha", "attention.window=8"]),
        (
            "l2a",
            vec![
                "attention.method=l2a",
                "attention.window=8",
                "train.router_hold_steps=2",
            ],
        ),
    ] {
        let (one, two) = (
            dir.join(format!("{name}-one")),
            dir.join(format!("{name}-two")),
        );
        cli("train -q")
            .flag("--out", &one)
            .set(&sets)
            .set(&extra)
            .ok();
        cli("train -q --gpus 2")
            .flag("--out", &two)
            .set(&sets)
            .set(&extra)
            .ok();
        same_weights(&one, &two);
        assert_eq!(log(&one), log(&two), "{name}");
    }
    let two = dir.join("plain-two");
    assert!(two.join("eval/eval.json").is_file());
    let config = std::fs::read_to_string(two.join("config.toml")).unwrap();
    assert!(config.contains("ranks = 2"), "{config}");
    // A rank count that does not divide the global batch's micro-batches is refused.
    let e = cli("train -q --gpus 3")
        .flag("--out", &dir.join("three"))
        .set(&sets)
        .fails();
    assert!(e.contains("not a multiple of train.ranks = 3"), "{e}");
}

/// Two ranks, each joining its two micro-batches of a step into one pass (`train.micro_batch`
/// 4), train as two ranks running them apart: every step's logged loss, learning rate and
/// gradient norm, and the weights, to rounding (a pass of 4 sums in another order than two of
/// 2). Each run says how many passes of how many sequences its step ran on a rank, so a join
/// that ran its micro-batches apart anyway shows.
#[test]
fn two_ranks_joining_their_micro_batches_train_as_apart() {
    let dir = scratch("join_ranks");
    let sets = settings(&synth(&dir, 6000));
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let o = cli("train --gpus 2")
            .flag("--out", &out)
            .set(&sets)
            .set(["train.grad_accum=4"])
            .set(extra)
            .ok();
        (out, String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let ((apart, said_apart), (joined, said_joined)) =
        (run("apart", &[]), run("joined", &["train.micro_batch=4"]));
    assert!(
        said_apart.contains("runs 2 passes of 2 sequences on each rank"),
        "{said_apart}"
    );
    assert!(
        said_joined.contains("runs 1 pass of 4 sequences on each rank"),
        "{said_joined}"
    );
    let numbers = |run: &Path| -> Vec<Vec<f64>> {
        log(run)
            .iter()
            .skip(1)
            .map(|l| l.split(',').map(|v| v.parse().unwrap_or(0.0)).collect())
            .collect()
    };
    let (a, b) = (numbers(&apart), numbers(&joined));
    assert_eq!(a.len(), 4);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!(
            x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-5),
            "{x:?} {y:?}"
        );
    }
    for ((n, x), (_, y)) in weights(&apart).iter().zip(&weights(&joined)) {
        let gap = (x - y).abs().max().double_value(&[]);
        assert!(gap < 1e-5, "{n} differs by {gap} when joined");
    }
}

/// A job stopped after 2 steps resumes with another rank count, and ends where one process
/// training straight through ends.
#[test]
fn a_job_resumes_with_another_number_of_ranks() {
    let dir = scratch("resume");
    let sets = settings(&synth(&dir, 6000));
    let straight = dir.join("straight");
    cli("train -q").flag("--out", &straight).set(&sets).ok();
    for (first, then, name) in [("2", "1", "two-then-one"), ("1", "2", "one-then-two")] {
        let run = dir.join(name);
        cli("train -q --stop-at-step 2 --gpus")
            .arg(first)
            .flag("--out", &run)
            .set(&sets)
            .ok();
        cli("train -q --resume --gpus")
            .arg(then)
            .flag("--out", &run)
            .ok();
        same_weights(&straight, &run);
        assert_eq!(log(&straight), log(&run), "{name}");
    }
}

/// A rank that dies stops the job at once, naming it; one that hangs stops it within the
/// collectives' timeout. The checkpoint written before is whole, and the job resumes from it
/// to the weights of a run never stopped.
#[test]
fn a_rank_that_dies_or_hangs_stops_the_job() {
    let dir = scratch("failing");
    let sets = settings(&synth(&dir, 6000));
    let straight = dir.join("straight");
    cli("train -q").flag("--out", &straight).set(&sets).ok();
    let run = dir.join("died");
    let o = common::bin()
        .args(["train", "-q", "--gpus", "2", "--out"])
        .arg(&run)
        .args(sets.iter().flat_map(|s| ["--set", s.as_str()]))
        .env("ATTNSWEEP_CRASH_RANK", "1")
        .env("ATTNSWEEP_CRASH_AT", "step_applied:3")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("rank 1 of 2 failed (killed by signal 6)"),
        "{e}"
    );
    assert!(e.contains("still running then, and stopped: rank 0"), "{e}");
    cli("train -q --resume --gpus 2").flag("--out", &run).ok();
    same_weights(&straight, &run);

    let run = dir.join("hung");
    let start = std::time::Instant::now();
    let o = common::bin()
        .args(["train", "-q", "--gpus", "2", "--out"])
        .arg(&run)
        .args(sets.iter().flat_map(|s| ["--set", s.as_str()]))
        .args(["--set", "train.dist_timeout_s=3"])
        .env("ATTNSWEEP_CRASH_RANK", "1")
        .env("ATTNSWEEP_CRASH_AT", "step_applied:3:hang")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("rank 0 of 2 failed") && e.contains("stopped: rank 1"),
        "{e}"
    );
    assert!(start.elapsed().as_secs() < 60, "{:?}", start.elapsed());
    assert_eq!(
        std::fs::read_to_string(run.join("checkpoints/latest"))
            .unwrap()
            .trim(),
        "step_00000002"
    );
}

/// A grid whose cells train on two CPU ranks each (`train.ranks`, which leaves a cell's
/// identity as it is) writes the tables of the same grid trained by one process a cell.
#[test]
fn a_sweep_of_two_rank_cells_equals_one_of_single_processes() {
    let dir = scratch("sweep");
    let data = dir.join("data");
    synth(&dir, 20_000);
    let grid = |ranks: usize| {
        let g = dir.join(format!("grid{ranks}.toml"));
        let set = format!("\"train.grad_accum\" = 2, \"train.ranks\" = {ranks}");
        std::fs::write(
            &g,
            format!(
                "name = \"ranks\"\n{}\n[[stage]]\nname = \"base\"\nset = {{ \"attention.method\" = \"full\", {set} }}\n\
                 [[stage]]\nname = \"aha\"\ninit_from = \"base\"\nset = {{ \"attention.method\" = \"aha\", {set} }}\n\
                 axes = {{ \"attention.window\" = [4, 8] }}\n",
                tiny_base(&data)
            ),
        )
        .unwrap();
        let out = dir.join(format!("out{ranks}"));
        cli("sweep -q").flag("--grid", &g).flag("--out", &out).ok();
        (g, out)
    };
    let ((_, one), (g, two)) = (grid(1), grid(2));
    assert_eq!(tables(&one), tables(&two));
    let log = std::fs::read_to_string(two.join("cells.json")).unwrap();
    assert!(log.contains("\"ranks\": 2"), "the cells ran on two ranks");
    // Slurm: each such cell asks for one node with its two GPUs.
    cli("sweep --emit slurm")
        .flag("--grid", &g)
        .flag("--out", &two)
        .ok();
    let script = std::fs::read_to_string(two.join("slurm/aha.sbatch")).unwrap();
    assert!(
        script.contains("#SBATCH --nodes=1 --gres=gpu:2"),
        "{script}"
    );
}

/// `sweep --join-micro-batches` trains a cell's share of each step as one pass: the same
/// cells by id, each run's config recording `train.micro_batch` (4 sequences: 2 micro-batches
/// of 2), and the losses of the sweep that trains them one micro-batch a pass, to rounding.
#[test]
fn a_sweep_joining_micro_batches_keeps_its_cells_and_losses() {
    let dir = scratch("join");
    let data = dir.join("data");
    synth(&dir, 20_000);
    let g = dir.join("grid.toml");
    std::fs::write(
        &g,
        format!(
            "name = \"join\"\n{}\n[[stage]]\nname = \"base\"\n\
             set = {{ \"attention.method\" = \"full\", \"train.batch_size\" = 2, \"train.grad_accum\" = 2 }}\n",
            tiny_base(&data)
        ),
    )
    .unwrap();
    let sweep = |join: bool| {
        let out = dir.join(format!("out-{join}"));
        let c = cli("sweep -q").flag("--grid", &g).flag("--out", &out);
        let c = c.flag("--devices", "0");
        match join {
            true => c.arg("--join-micro-batches").ok(),
            false => c.ok(),
        };
        out
    };
    let (apart, joined) = (sweep(false), sweep(true));
    let e = cli("sweep -q --join-micro-batches")
        .flag("--grid", &g)
        .flag("--out", dir.join("refused"))
        .fails();
    assert!(e.contains("give --devices"), "{e}");
    let e = cli("sweep -q --cuda-graph")
        .flag("--grid", &g)
        .flag("--out", dir.join("refused"))
        .fails();
    assert!(e.contains("--cuda-graph captures a cell's step"), "{e}");
    let summary = |out: &Path| -> Vec<(String, f64)> {
        let mut r = csv::Reader::from_path(out.join("summary.csv")).unwrap();
        let head = r.headers().unwrap().clone();
        let col = |name: &str| head.iter().position(|h| h == name).unwrap();
        let (cell, loss) = (col("cell"), col("loss"));
        r.records()
            .map(|x| x.unwrap())
            .map(|x| (x[cell].to_string(), x[loss].parse().unwrap()))
            .collect()
    };
    let (a, b) = (summary(&apart), summary(&joined));
    assert_eq!(a.len(), 1);
    assert_eq!(
        a[0].0, b[0].0,
        "joining changes where the work runs, not the cell"
    );
    assert!((a[0].1 - b[0].1).abs() < 1e-4, "{a:?} {b:?}");
    let config =
        |out: &Path| std::fs::read_to_string(out.join(&a[0].0).join("config.toml")).unwrap();
    assert!(
        config(&joined).contains("micro_batch = 4"),
        "{}",
        config(&joined)
    );
    assert!(config(&apart).contains("micro_batch = 0"));
}
