//! Reliability: runs killed at random points and at every crash point resume to exactly the
//! result of an uninterrupted run; killed sweep runners never cost a finished cell; the
//! non-finite guard keeps the last good checkpoint. `ATTNSWEEP_LONG_TESTS=1` runs the long
//! campaigns (200 random kills); CI runs the short ones.

mod common;
use common::bin;

fn synth(dir: &Path) -> String {
    common::synth(dir, 20_000)
}

use attnsweep::util::rng::Rng;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn scratch(name: &str) -> PathBuf {
    common::scratch("rel", name)
}

fn long() -> bool {
    std::env::var("ATTNSWEEP_LONG_TESTS").is_ok_and(|v| v == "1")
}

/// A tiny run that checkpoints, logs and evaluates often, so kills land in every phase.
fn run_settings(data: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        data,
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "data.seq_len=64",
        "train.batch_size=4",
        "eval.max_batches=2",
        "train.steps=40",
        "train.warmup_steps=2",
        "train.ckpt_every=4",
        "train.eval_every=10",
        "train.log_every=1",
        "train.device=cpu",
        "train.keep_checkpoints=2",
    ]
    .iter()
    .chain(extra)
    .flat_map(|s| ["--set".to_string(), s.to_string()])
    .collect();
    v.insert(0, "-q".into());
    v
}

/// `train` into `out`, fresh or resumed as the directory says.
fn train_cmd(out: &Path, settings: &[String]) -> Command {
    let mut c = bin();
    c.arg("train").arg("--out").arg(out);
    if out.join("config.toml").exists() {
        c.arg("--resume");
    } else {
        c.args(settings);
    }
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

fn weights(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut v = tch::Tensor::read_safetensors(path).unwrap();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn final_weights(run: &Path) -> Vec<(String, tch::Tensor)> {
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    weights(
        &run.join("checkpoints")
            .join(latest.trim())
            .join("model.safetensors"),
    )
}

/// The log without the columns that differ between runs: the rate and the peak memory.
fn log_without_timing(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            f.iter()
                .enumerate()
                // tokens_per_s, and peak_gib: a resumed process's own peak memory.
                .filter(|(i, _)| *i != 4 && *i != 8)
                .map(|(_, v)| *v)
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect()
}

/// What a reader may see after any kill: `latest` names a complete checkpoint, and every
/// finished file parses.
fn check_consistent(run: &Path) {
    let latest = run.join("checkpoints/latest");
    if latest.exists() {
        let dir = run
            .join("checkpoints")
            .join(std::fs::read_to_string(&latest).unwrap().trim());
        for f in ["model.safetensors", "optim.safetensors"] {
            assert!(
                !weights(&dir.join(f)).is_empty(),
                "{} unreadable",
                dir.join(f).display()
            );
        }
        let state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).unwrap())
                .unwrap();
        assert!(state["step"].as_u64().is_some());
    }
    if run.join("eval/eval.json").exists() {
        let _: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("eval/eval.json")).unwrap())
                .unwrap();
    }
}

/// An evaluation killed among its probe batches resumes after the last batch its journal
/// holds, and answers and scores as an evaluation never killed does; the finished evaluation
/// removes its journal; a journal of other weights is set aside, not mixed in.
#[test]
fn killed_probes_resume_after_their_last_finished_batch() {
    let dir = scratch("probes");
    // Probes read text: a byte-level data set.
    let data = format!("data.dir={}", common::text_data(&dir).display());
    let run = dir.join("run");
    let settings = run_settings(&data, &["train.steps=4", "train.eval_every=0"]);
    let o = train_cmd(&run, &settings).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let eval = |out: &Path| {
        let mut c = bin();
        c.arg("eval").arg("--run").arg(&run).arg("--out").arg(out);
        for s in [
            "eval.tasks=[passkey]",
            "eval.lengths=[128]",
            "eval.samples=6",
            "eval.batch_size=2",
            "eval.max_batches=1",
        ] {
            c.args(["--set", s]);
        }
        c.stdout(Stdio::null()).stderr(Stdio::piped());
        c
    };
    let reference = dir.join("reference");
    let o = eval(&reference).arg("-q").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let killed = dir.join("killed");
    let journal = killed.join("probe_journal.jsonl");
    let o = eval(&killed)
        .arg("-q")
        .env("ATTNSWEEP_CRASH_AT", "probe_batch:2")
        .output()
        .unwrap();
    assert!(!o.status.success() && journal.is_file());
    let o = eval(&killed).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("probes: 2 batches finished by an interrupted run"),
        "{err}"
    );
    assert!(!journal.exists());
    let read = |d: &Path, f: &str| std::fs::read_to_string(d.join(f)).unwrap();
    assert_eq!(
        common::probe_samples(&reference),
        common::probe_samples(&killed)
    );
    for f in ["tasks.csv", "niah.csv"] {
        assert_eq!(read(&reference, f), read(&killed, f), "{f}");
    }
    // A journal left by other weights (here: a key that is not this evaluation's) is set
    // aside: the evaluation runs every batch and says nothing of resuming.
    std::fs::write(&journal, "{\"key\":\"other weights\"}\n").unwrap();
    let o = eval(&killed).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && !err.contains("interrupted run"),
        "{err}"
    );
    assert_eq!(read(&reference, "tasks.csv"), read(&killed, "tasks.csv"));
}

#[test]
fn killed_training_resumes_to_the_uninterrupted_result() {
    let dir = scratch("train");
    let data = synth(&dir);
    let settings = run_settings(&data, &[]);
    let reference = dir.join("reference");
    let o = train_cmd(&reference, &settings).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let run = dir.join("killed");
    let mut kills = 0;
    // Deterministic crashes inside every write path, at several occurrences.
    let training_points = attnsweep::util::fault::POINTS
        .iter()
        .filter(|p| !p.starts_with("sweep") && !p.starts_with("probe"));
    for point in training_points {
        for n in [1, 3] {
            let o = train_cmd(&run, &settings)
                .env("ATTNSWEEP_CRASH_AT", format!("{point}:{n}"))
                .output()
                .unwrap();
            if !o.status.success() {
                kills += 1;
            }
            check_consistent(&run);
        }
    }
    assert!(kills >= 8, "crash points were reached {kills} times");
    // A panic (a bug, or libtorch failing an allocation, which unwinds through tch) comes
    // back as an error, never as a Rust panic, and leaves the run as consistent as a crash.
    let panicked = dir.join("panicked");
    for (how, says) in [
        ("panic", "internal error at src/util/fault.rs"),
        (
            "alloc",
            "out of memory: DefaultCPUAllocator: can't allocate memory",
        ),
    ] {
        let o = train_cmd(&panicked, &settings)
            .env("ATTNSWEEP_CRASH_AT", format!("step_applied:2:{how}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(
            err.contains(says) && !err.contains("panicked at") && !err.contains("frame #"),
            "{err}"
        );
        check_consistent(&panicked);
    }
    // Random SIGKILLs, from process start-up to the final evaluation.
    let mut rng = Rng::new(20261122);
    let random_kills = if long() { 200 } else { 14 };
    // Kill delays shrink whenever a run finishes first, so a fast machine still gets its kills.
    let (mut max_delay, mut random, mut attempts) = (2500u64, 0, 0);
    while random < random_kills {
        attempts += 1;
        assert!(
            attempts < 20 * random_kills,
            "only {random} of {random_kills} kills landed"
        );
        // Start again from scratch now and then, so early phases are hit too.
        if rng.uniform() < 0.2 {
            let _ = std::fs::remove_dir_all(&run);
        }
        let mut child = train_cmd(&run, &settings).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(rng.below(max_delay)));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            random += 1;
        } else {
            // The run finished: start over, and kill sooner.
            let _ = std::fs::remove_dir_all(&run);
            max_delay = (max_delay * 3 / 4).max(200);
        }
        child.wait().unwrap();
        check_consistent(&run);
    }
    kills += random;
    eprintln!("training: {kills} kills");
    assert!(kills >= 20);
    let o = train_cmd(&run, &settings).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    for ((na, a), (nb, b)) in final_weights(&reference).iter().zip(&final_weights(&run)) {
        assert_eq!(na, nb);
        assert!(a.equal(b), "{na} differs after kills");
    }
    assert_eq!(
        log_without_timing(&reference.join("train_log.csv")),
        log_without_timing(&run.join("train_log.csv"))
    );
    assert_eq!(
        std::fs::read_to_string(reference.join("val_log.csv")).unwrap(),
        std::fs::read_to_string(run.join("val_log.csv")).unwrap()
    );
    let loss = |r: &Path| {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(r.join("eval/eval.json")).unwrap())
                .unwrap();
        v["report"]["loss"].as_f64().unwrap()
    };
    assert_eq!(loss(&reference), loss(&run));
    let leftovers: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "half-written checkpoints left behind");
}

fn grid(dir: &Path, data: &str) -> PathBuf {
    let g = dir.join("grid.toml");
    let base: String = run_settings(data, &[])
        .iter()
        .filter_map(|s| s.split_once('='))
        .map(|(k, v)| {
            let v = if v.parse::<f64>().is_ok() {
                v.to_string()
            } else {
                format!("{v:?}")
            };
            format!("{k} = {v}\n")
        })
        .collect();
    std::fs::write(
        &g,
        format!(
            "name = \"rel\"\n[base]\n{base}\n[[stage]]\nname = \"a\"\nkind = \"train\"\n[stage.axes]\n\"attention.method\" = [\"full\", \"swa\", \"ppa\"]\n"
        ),
    )
    .unwrap();
    g
}

/// (cell, state, attempts, eval.json bytes) of every cell directory.
fn cell_states(out: &Path) -> Vec<(String, String, u64, Option<Vec<u8>>)> {
    let mut v = Vec::new();
    let Ok(entries) = std::fs::read_dir(out) else {
        return v;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(s) = std::fs::read_to_string(p.join("status.json")) else {
            continue;
        };
        let s: serde_json::Value = serde_json::from_str(&s).unwrap();
        v.push((
            e.file_name().to_string_lossy().into_owned(),
            s["state"].as_str().unwrap().to_string(),
            s["attempts"].as_u64().unwrap(),
            std::fs::read(p.join("eval/eval.json")).ok(),
        ));
    }
    v.sort();
    v
}

fn sweep_cmd(g: &Path, out: &Path) -> Command {
    let mut c = bin();
    c.args([
        "sweep",
        "-q",
        "--grid",
        g.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// Runs the sweep until every cell is done (killed runners may leave children finishing).
fn finish(g: &Path, out: &Path, cells: usize) {
    let start = Instant::now();
    loop {
        let o = sweep_cmd(g, out).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        if cell_states(out).iter().filter(|c| c.1 == "done").count() == cells {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "cells never finished"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn killed_sweep_runners_never_redo_or_lose_a_cell() {
    let dir = scratch("sweep");
    let data = synth(&dir);
    let g = grid(&dir, &data);
    let clean = dir.join("clean");
    finish(&g, &clean, 3);

    let out = dir.join("killed");
    let mut rng = Rng::new(7);
    let mut kills = 0;
    let o = sweep_cmd(&g, &out)
        .env("ATTNSWEEP_CRASH_AT", "sweep_cell_finished:1")
        .output()
        .unwrap();
    kills += !o.status.success() as usize;
    let rounds = if long() { 40 } else { 6 };
    for _ in 0..rounds {
        // A finished sweep starts over, so every round can interrupt something.
        if cell_states(&out).iter().filter(|c| c.1 == "done").count() == 3 {
            std::fs::remove_dir_all(&out).unwrap();
        }
        let before: Vec<_> = cell_states(&out)
            .into_iter()
            .filter(|c| c.1 == "done")
            .collect();
        let mut child = sweep_cmd(&g, &out).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(rng.below(4000)));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
        }
        child.wait().unwrap();
        // Finished cells stay finished, with the same attempt count and the same results.
        let after = cell_states(&out);
        for b in &before {
            assert!(after.contains(b), "cell {} changed after a kill", b.0);
        }
    }
    eprintln!("sweep: {kills} runner kills");
    finish(&g, &out, 3);
    let evals = |o: &Path| {
        cell_states(o)
            .into_iter()
            .map(|c| (c.0, c.3))
            .collect::<Vec<_>>()
    };
    let strip = |v: Vec<(String, Option<Vec<u8>>)>| {
        v.into_iter()
            .map(|(id, e)| {
                let j: serde_json::Value = serde_json::from_slice(&e.unwrap()).unwrap();
                (id, j["report"]["loss"].as_f64().unwrap())
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        strip(evals(&clean)),
        strip(evals(&out)),
        "results differ from an uninterrupted sweep"
    );
}

#[test]
fn non_finite_step_stops_keeps_the_last_good_checkpoint_and_fails_the_cell() {
    let dir = scratch("nan");
    let data = synth(&dir);
    // Adam without second-moment averaging at a huge rate, no clipping: diverges at step 3.
    let blow_up = [
        "train.lr=9.9",
        "train.grad_clip=0",
        "train.beta2=0",
        "train.warmup_steps=0",
        "train.ckpt_every=1",
    ];
    let run = dir.join("run");
    let o = train_cmd(&run, &run_settings(&data, &blow_up))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    let step: usize = err
        .split("at step ")
        .nth(1)
        .and_then(|s| s.split(':').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no step named: {err}"));
    assert!(err.contains("non-finite"), "{err}");
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step_{:08}", step - 1));
    for (n, t) in final_weights(&run) {
        assert!(
            t.isfinite().all().int64_value(&[]) == 1,
            "{n} saved non-finite"
        );
    }
    // In a sweep the cell is failed with that message and its sibling finishes.
    let g = dir.join("grid.toml");
    let base = std::fs::read_to_string(grid(&dir, &data)).unwrap();
    std::fs::write(
        &g,
        base.replace(
            "[stage.axes]\n\"attention.method\" = [\"full\", \"swa\", \"ppa\"]",
            "[stage.zip]\n\"train.lr\" = [0.003, 9.9]\n\"train.grad_clip\" = [1.0, 0.0]\n\"train.beta2\" = [0.95, 0.0]\n\"train.warmup_steps\" = [2, 0]",
        ),
    )
    .unwrap();
    let out = dir.join("sweep");
    let o = sweep_cmd(&g, &out).output().unwrap();
    assert!(
        !o.status.success(),
        "a failed cell fails the sweep's exit status"
    );
    let states = cell_states(&out);
    assert_eq!(
        states.iter().filter(|c| c.1 == "done").count(),
        1,
        "{states:?}"
    );
    let failed = states.iter().find(|c| c.1 == "failed").unwrap();
    let status = std::fs::read_to_string(out.join(&failed.0).join("status.json")).unwrap();
    assert!(status.contains("non-finite"), "{status}");
}

fn temporaries(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            found.push(p.clone());
        }
        if p.is_dir() {
            found.extend(temporaries(&p));
        }
    }
    found
}

#[test]
fn a_full_disk_fails_clearly_corrupts_nothing_and_resume_recovers() {
    let dir = scratch("disk");
    let data = synth(&dir);
    let settings = run_settings(&data, &[]);
    let reference = dir.join("reference");
    assert!(train_cmd(&reference, &settings)
        .output()
        .unwrap()
        .status
        .success());
    let run = dir.join("run");
    let mut failures = 0;
    // Writes: the config, a log row per step, checkpoints, evaluation reports.
    for n in [1, 2, 3, 4, 5, 7, 9, 12, 15, 20, 30] {
        let o = train_cmd(&run, &settings)
            .env("ATTNSWEEP_FAIL_WRITE", n.to_string())
            .output()
            .unwrap();
        if o.status.success() {
            continue;
        }
        failures += 1;
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("No space left on device") && err.contains(&*dir.to_string_lossy()),
            "write {n}: {err}"
        );
        check_consistent(&run);
        assert!(
            temporaries(&run).is_empty(),
            "write {n} left {:?}",
            temporaries(&run)
        );
    }
    assert!(
        failures >= 8,
        "only {failures} injected failures were reached"
    );
    assert!(train_cmd(&run, &settings)
        .output()
        .unwrap()
        .status
        .success());
    for ((na, a), (_, b)) in final_weights(&reference).iter().zip(&final_weights(&run)) {
        assert!(a.equal(b), "{na} differs after failed writes");
    }
    // A sweep's own writes (its data lock, a cell's directory, lock and state) on a full disk
    // name the file they failed on too.
    let g = grid(&dir, &data);
    let mut named = 0;
    for n in 1..=6 {
        let out = dir.join(format!("sweep-{n}"));
        let o = sweep_cmd(&g, &out)
            .env("ATTNSWEEP_FAIL_WRITE", n.to_string())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        if err.contains("No space left on device") {
            assert!(
                err.contains(&*out.to_string_lossy()),
                "sweep write {n}: {err}"
            );
            named += 1;
        }
    }
    assert!(
        named >= 2,
        "only {named} of the sweep's writes failed in the sweep itself"
    );
    // An output path that cannot be a directory.
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let o = train_cmd(&file.join("run"), &settings).output().unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot create output directory"));
}

#[test]
fn a_second_trainer_on_one_run_directory_is_refused() {
    let dir = scratch("twice");
    let data = synth(&dir);
    let run = dir.join("run");
    let mut first = train_cmd(&run, &run_settings(&data, &["train.steps=100000"]))
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !run.join("config.toml").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the first trainer never started"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = train_cmd(&run, &[]).output().unwrap();
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("another attnsweep process is training into")
    );
    // Once the first is gone, resuming works.
    let o = train_cmd(&run, &[])
        .arg("--stop-at-step")
        .arg("1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
