//! End-to-end tests: the binary on tiny configurations, on the CPU.

mod common;
use common::{bin, cli, synth, tiny_base, tiny_grid};

use std::path::{Path, PathBuf};
use std::process::Output;

fn scratch(name: &str) -> PathBuf {
    common::scratch("e2e", name)
}

/// The settings of the tests' tiny model (2 layers of width 32, sequences of 64 tokens).
const TINY: [&str; 6] = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "data.seq_len=64",
    "train.batch_size=4",
    "eval.max_batches=4",
];

/// `train -q` of the tiny model on the corpus `data` (a `data.dir=` setting) into `dir/out`.
fn tiny_train(dir: &Path, data: &str, out: &str) -> common::Cli {
    cli("train -q")
        .flag("--out", dir.join(out))
        .set([data])
        .set(TINY)
}

/// `tiny_train` with `extra` arguments, which must succeed.
fn train(dir: &Path, data: &str, out: &str, extra: &[&str]) -> Output {
    extra
        .iter()
        .fold(tiny_train(dir, data, out), |c, a| c.arg(a))
        .ok()
}

/// `attnsweep sweep --grid <grid> --out <out> <extra>`, which must succeed.
fn sweep(grid: &Path, out: &Path, extra: &[&str]) -> Output {
    extra
        .iter()
        .fold(
            cli("sweep").flag("--grid", grid).flag("--out", out),
            |c, a| c.arg(a),
        )
        .ok()
}

fn log_rows(path: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').map(String::from).collect())
        .collect()
}

#[test]
fn train_then_eval_writes_everything() {
    let d = scratch("basic");
    let data = synth(&d, 20_000);
    train(
        &d,
        &data,
        "run",
        &[
            "--set",
            "train.steps=6",
            "--set",
            "train.warmup_steps=2",
            "--set",
            "train.log_every=2",
            "--set",
            "attention.method=ppa",
            "--set",
            "attention.window=4",
        ],
    );
    let run = d.join("run");
    for f in [
        "config.toml",
        "train_log.csv",
        "val_log.csv",
        "checkpoints/latest",
        "checkpoints/step_00000006/model.safetensors",
        "checkpoints/step_00000006/optim.safetensors",
        "eval/eval.json",
        "eval/eval.csv",
        "eval/eval_buckets.csv",
        "eval/config.toml",
    ] {
        assert!(run.join(f).is_file(), "missing {f}");
    }
    let cfg = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        cfg.contains("vocab_size = 256") && cfg.contains("method = \"ppa\""),
        "resolved config:\n{cfg}"
    );
    let rows = log_rows(&run.join("train_log.csv"));
    assert_eq!(
        rows.iter().map(|r| r[0].as_str()).collect::<Vec<_>>(),
        ["2", "4", "6"]
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("eval/eval.json")).unwrap())
            .unwrap();
    let work = json["report"]["attention"]["pairs_vs_full"]
        .as_f64()
        .unwrap();
    assert!(
        work > 0.0 && work < 0.5,
        "PPA attends {work} of full attention's pairs"
    );
    assert_eq!(json["report"]["checkpoint_step"], 6);

    // SWA-ZS: the same weights evaluated with a window, written beside, not over, the original.
    let o = cli("eval")
        .flag("--run", &run)
        .set(["attention.method=swa", "attention.window=8"])
        .ok();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("val loss") && out.contains("out_of_context"),
        "{out}"
    );
    let zs = run.join("eval-attention.method_swa_attention.window_8/eval.json");
    let zs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(zs).unwrap()).unwrap();
    let expected = (8.0 * 64.0 - 8.0 * 7.0 / 2.0) / (64.0 * 65.0 / 2.0);
    assert!(
        (zs["report"]["attention"]["pairs_vs_full"].as_f64().unwrap() - expected).abs() < 1e-12
    );
    assert_eq!(zs["config"]["attention"]["method"], "swa");

    // Evaluated on sequences twice as long as training's.
    cli("eval -q")
        .flag("--run", &run)
        .set(["eval.seq_len=128"])
        .ok();
    let long: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(run.join("eval-eval.seq_len_128/eval.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(long["report"]["seq_len"], 128);
    // Full causal pairs: rows x 4 heads x 2 layers x 128 * 129 / 2.
    let rows = long["report"]["tokens"].as_f64().unwrap() / 128.0;
    assert_eq!(
        long["report"]["attention"]["full_causal_pairs"].as_f64(),
        Some(rows * 4.0 * 2.0 * (128.0 * 129.0 / 2.0))
    );
    // Asked for, the evaluation also times a forward and decoding over the cache, which a
    // full-attention model fills with the whole context.
    cli("eval -q")
        .flag("--run", &run)
        .set(["eval.timing=true"])
        .flag("--out", &run.join("timed"))
        .ok();
    let timed: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("timed/eval.json")).unwrap())
            .unwrap();
    let t = &timed["report"]["timing"];
    assert!(t["decode_tokens_per_s"].as_f64().unwrap() > 0.0, "{t}");
    assert_eq!(
        t["decode_cache_bytes"].as_f64(),
        timed["report"]["kv_cache_bytes_total"].as_f64()
    );
    assert!(long["report"].get("timing").is_none());
}

#[test]
fn resume_equals_uninterrupted_bitwise() {
    let d = scratch("resume");
    let data = synth(&d, 20_000);
    let common = [
        "--set",
        "train.steps=9",
        "--set",
        "train.warmup_steps=2",
        "--set",
        "train.ckpt_every=3",
        "--set",
        "train.log_every=1",
        "--set",
        "train.grad_accum=2",
    ];
    train(&d, &data, "whole", &common);
    let mut first = common.to_vec();
    first.extend(["--stop-at-step", "4"]);
    train(&d, &data, "parts", &first);
    assert!(
        !d.join("parts/eval").exists(),
        "a stopped run is not finished"
    );
    // Simulate rows an interrupted run wrote after its checkpoint: resume must drop them.
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.join("parts/train_log.csv"))
        .map(|mut f| {
            use std::io::Write;
            writeln!(f, "5,9.9,0,0,0,0").unwrap();
        })
        .unwrap();
    let parts = d.join("parts");
    let p = parts.to_str().unwrap();
    // Settings that define the run are refused on resume, each named, and nothing is written.
    let before = std::fs::read(parts.join("config.toml")).unwrap();
    let listing = |dir: &Path| {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let ckpts = listing(&parts.join("checkpoints"));
    let err = cli("train -q --resume")
        .flag("--out", p)
        .set([
            "train.steps=12",
            "attention.method=swa",
            "train.log_every=2",
        ])
        .fails();
    for needle in [
        "train.steps (saved 9, now 12)",
        "attention.method",
        "--init-from",
    ] {
        assert!(err.contains(needle), "{needle:?} not in: {err}");
    }
    assert!(
        !err.contains("train.log_every ("),
        "a setting resume may change is not refused: {err}"
    );
    assert_eq!(std::fs::read(parts.join("config.toml")).unwrap(), before);
    assert_eq!(listing(&parts.join("checkpoints")), ckpts);
    // Settings that leave the computation as it was change, and config.toml records them:
    // recomputing every block in the backward (activation checkpointing) gives the same
    // gradients bit for bit.
    cli("train -q --resume")
        .flag("--out", p)
        .set(["train.eval_every=4", "train.activation_checkpointing=full"])
        .ok();
    let saved = std::fs::read_to_string(parts.join("config.toml")).unwrap();
    assert!(saved.contains("eval_every = 4"), "{saved}");
    assert!(
        saved.contains("activation_checkpointing = \"full\""),
        "{saved}"
    );
    let a = std::fs::read(d.join("whole/checkpoints/step_00000009/model.safetensors")).unwrap();
    let b = std::fs::read(d.join("parts/checkpoints/step_00000009/model.safetensors")).unwrap();
    assert!(a == b, "resumed weights differ from the uninterrupted run");
    let a = std::fs::read(d.join("whole/checkpoints/step_00000009/optim.safetensors")).unwrap();
    let b = std::fs::read(d.join("parts/checkpoints/step_00000009/optim.safetensors")).unwrap();
    assert!(a == b, "resumed optimizer state differs");
    let losses = |p: &str| {
        log_rows(&d.join(p).join("train_log.csv"))
            .into_iter()
            .map(|r| (r[0].clone(), r[1].clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(losses("whole"), losses("parts"));
    let ev = |p: &str| std::fs::read_to_string(d.join(p).join("eval/eval.csv")).unwrap();
    assert_eq!(ev("whole"), ev("parts"));
    // Only the newest checkpoints are kept.
    let kept: Vec<_> = std::fs::read_dir(d.join("parts/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(kept.len(), 3, "{kept:?}");
}

#[test]
fn init_from_loads_matching_names_and_reports_new_ones() {
    let d = scratch("init");
    let data = synth(&d, 20_000);
    train(
        &d,
        &data,
        "base",
        &["--set", "train.steps=3", "--set", "train.warmup_steps=1"],
    );
    let base = d.join("base");
    let o = train(
        &d,
        &data,
        "cpt",
        &[
            "--set",
            "train.steps=2",
            "--set",
            "train.warmup_steps=0",
            "--set",
            "attention.method=swa",
            "--init-from",
            base.to_str().unwrap(),
        ],
    );
    assert!(o.status.success());
    // Untied head: the base run has no lm_head, so it is initialised fresh and reported.
    let cpt2 = d.join("cpt2");
    let o = cli("train")
        .flag("--out", &cpt2)
        .set([&data])
        .set([
            "train.steps=1",
            "train.warmup_steps=0",
            "model.tie_word_embeddings=false",
        ])
        .flag("--init-from", &base)
        .set(TINY)
        .ok();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("initialised 1 new") && err.contains("lm_head.weight"),
        "{err}"
    );
    // Without --config the run starts from the config of the run it continues (its shape,
    // its data), said in a note; --set still changes it.
    let inherit = d.join("inherit");
    let o = cli("train")
        .flag("--out", &inherit)
        .set(["train.steps=1", "train.warmup_steps=0"])
        .flag("--init-from", &base)
        .ok();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no --config") && err.contains("config.toml"),
        "{err}"
    );
    let config = |run: &Path| std::fs::read_to_string(run.join("config.toml")).unwrap();
    let model = |text: String| text.parse::<toml::Table>().unwrap()["model"].clone();
    assert_eq!(model(config(&inherit)), model(config(&base)));
    // A shape mismatch is an error naming the tensor.
    let err = tiny_train(&d, &data, "bad")
        .set(["train.steps=1", "train.warmup_steps=0"])
        .flag("--init-from", &base)
        .set(["model.intermediate_size=48"])
        .fails();
    assert!(err.contains("mlp") && err.contains("shape"), "{err}");
}

#[test]
fn data_prepare_then_train_on_text() {
    let d = scratch("text");
    let text = d.join("a.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(200),
    )
    .unwrap();
    let ds = d.join("ds");
    cli("data prepare")
        .flag("--input", &text)
        .flag("--out", &ds)
        .words("--val-fraction 0.2")
        .ok();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ds.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["vocab_size"], 257);
    assert_eq!(
        meta["train_tokens"].as_u64().unwrap() + meta["val_tokens"].as_u64().unwrap(),
        9001
    );
    let data = format!("data.dir={}", ds.display());
    train(
        &d,
        &data,
        "run",
        &["--set", "train.steps=2", "--set", "train.warmup_steps=0"],
    );
    assert!(
        !d.join("run/eval/eval_buckets.csv").exists(),
        "text has no dependency buckets"
    );
}

#[test]
fn bad_inputs_fail_clearly_and_overwrite_nothing() {
    let d = scratch("bad");
    let data = synth(&d, 20_000);
    let cfg = d.join("c.toml");
    let out = d.join("never");
    let out_s = out.to_str().unwrap();
    for (text, needle) in [
        ("[model\nhidden_size = 3", "not valid TOML"),
        ("[model]\nhidden = 3\n", "unknown field `hidden`"),
        (
            "[attention]\nwindow = 0\n",
            "attention.window = 0 is out of range",
        ),
        ("[train]\nlr = -1.0\n", "train.lr"),
    ] {
        std::fs::write(&cfg, text).unwrap();
        let err = cli("train")
            .flag("--config", &cfg)
            .flag("--out", out_s)
            .set([&data])
            .fails();
        assert!(err.contains(needle), "{text:?}: {err}");
    }
    assert!(cli("train")
        .flag("--out", out_s)
        .set(["data.dir=/nonexistent"])
        .fails()
        .contains("not a prepared data set"));
    assert!(
        !out.exists(),
        "a failed start must not create the run directory"
    );

    // A run, then attempts that must leave it untouched.
    train(
        &d,
        &data,
        "run",
        &["--set", "train.steps=2", "--set", "train.warmup_steps=0"],
    );
    let run = d.join("run");
    let snapshot =
        |p: &Path| std::fs::read(p.join("checkpoints/step_00000002/model.safetensors")).unwrap();
    let before = snapshot(&run);
    assert!(tiny_train(&d, &data, "run")
        .fails()
        .contains("already holds a run"));
    assert_eq!(snapshot(&run), before);

    // Truncated checkpoint.
    let ckpt = run.join("checkpoints/step_00000002/model.safetensors");
    let cut = d.join("cut.safetensors");
    std::fs::write(&cut, &before[..before.len() / 2]).unwrap();
    let err = cli("eval").flag("--run", &run).flag("--ckpt", &cut).fails();
    assert!(err.contains("truncated or corrupt"), "{err}");
    assert_eq!(std::fs::read(&ckpt).unwrap(), before);

    // Missing and truncated shards.
    let copy = d.join("data2");
    std::fs::create_dir_all(&copy).unwrap();
    for f in [
        "meta.json",
        "train_000.bin",
        "train_000.deps.bin",
        "val_000.deps.bin",
    ] {
        std::fs::copy(d.join("data").join(f), copy.join(f)).unwrap();
    }
    let err = cli("train")
        .flag("--out", out_s)
        .set([&format!("data.dir={}", copy.display())])
        .fails();
    assert!(err.contains("val_000.bin"), "{err}");
    let val = std::fs::read(d.join("data/val_000.bin")).unwrap();
    std::fs::write(copy.join("val_000.bin"), &val[..val.len() - 3]).unwrap();
    let err = cli("train")
        .flag("--out", out_s)
        .set([&format!("data.dir={}", copy.display())])
        .fails();
    assert!(err.contains("truncated"), "{err}");
    assert!(!out.exists());

    // Unwritable output directory (a regular file stands where the directory should be).
    let blocker = d.join("file");
    std::fs::write(&blocker, b"keep me").unwrap();
    let inside = blocker.join("run");
    let err = cli("train").flag("--out", &inside).set([&data]).fails();
    assert!(err.contains("cannot create output directory"), "{err}");
    assert_eq!(std::fs::read(&blocker).unwrap(), b"keep me");

    // Data sets are never overwritten.
    let err = cli("data synth").flag("--out", &d.join("data")).fails();
    assert!(err.contains("already holds a data set"), "{err}");

    // Non-finite numbers, from overrides and flags, and settings an override breaks, are
    // refused naming the override; nothing is created.
    for (sets, needle) in [
        (
            &["attention.ppa_power=nan"][..],
            "attention.ppa_power = NaN is not a finite number",
        ),
        (
            &["train.grad_clip=inf"],
            "train.grad_clip = inf is not a finite number",
        ),
        (&["data.seq_len=1"], "--set data.seq_len=1"),
        (&["eval.max_length=1"], "eval.max_length = 1"),
        // The val split (4096 tokens) cannot hold one evaluated sequence: found before the
        // first step, not after the last.
        (&["data.seq_len=5000"], "the val split"),
        (&["eval.seq_len=5000"], "eval.seq_len = 5000"),
        // Memory the machine does not have, refused with the estimate.
        (&["train.batch_size=1048576"], "GiB of memory"),
        (
            &["model.hidden_size=65536", "model.num_attention_heads=64"],
            "GiB of memory",
        ),
    ] {
        let err = cli("train")
            .flag("--out", out_s)
            .set([&data])
            .set(sets.iter())
            .fails();
        assert!(err.contains(needle), "{sets:?}: {err}");
        assert!(!err.contains("panicked"), "{sets:?}: {err}");
    }
    for (command, flag, value) in [
        ("prune", "--run", "--threshold nan"),
        ("data synth", "--out", "--alpha nan"),
    ] {
        let err = cli(command).flag(flag, out_s).words(value).fails();
        assert!(err.contains("not a finite number"), "{command}: {err}");
    }
    assert!(!out.exists());

    // meta.json that does not describe its shards: a vocabulary beyond any model, and token
    // counts the shards do not have.
    let meta_path = d.join("data/meta.json");
    let meta_text = std::fs::read_to_string(&meta_path).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta_text).unwrap();
    let bad_data = d.join("bad-data");
    std::fs::create_dir_all(&bad_data).unwrap();
    for f in std::fs::read_dir(d.join("data")).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), bad_data.join(f.file_name())).unwrap();
    }
    let bad_set = format!("data.dir={}", bad_data.display());
    for (key, value, needle) in [
        ("vocab_size", 100_000_000u64, "model.vocab_size = 100000000"),
        (
            "val_tokens",
            4097,
            "meta.json gives the val split 4097 tokens",
        ),
    ] {
        let mut m = meta.clone();
        m[key] = value.into();
        std::fs::write(bad_data.join("meta.json"), m.to_string()).unwrap();
        let err = cli("train").flag("--out", out_s).set([&bad_set]).fails();
        assert!(err.contains(needle), "{key}: {err}");
    }
    assert!(!out.exists());

    // A checkpoint of a longer run than config.toml describes is refused on resume; an
    // empty `latest` is named; a bad override of eval is blamed, not the run.
    let state = run.join("checkpoints/step_00000002/state.json");
    let state_text = std::fs::read_to_string(&state).unwrap();
    std::fs::write(&state, state_text.replace("\"step\": 2", "\"step\": 5")).unwrap();
    let err = cli("train").flag("--out", &run).words("--resume").fails();
    assert!(err.contains("beyond train.steps = 2"), "{err}");
    std::fs::write(&state, &state_text).unwrap();
    let latest = run.join("checkpoints/latest");
    let latest_text = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, b"").unwrap();
    let err = cli("eval").flag("--run", &run).fails();
    assert!(err.contains("checkpoints/latest is empty"), "{err}");
    std::fs::write(&latest, &latest_text).unwrap();
    let err = cli("eval")
        .flag("--run", &run)
        .set(["attention.window=0"])
        .fails();
    assert!(
        err.contains("--set attention.window=0") && !err.contains("not a run directory"),
        "{err}"
    );
    assert_eq!(snapshot(&run), before);

    // A run evaluated before it finished: eval says so and records the step.
    let part = d.join("part");
    let o = cli("train")
        .flag("--out", &part)
        .set([&data])
        .set(["train.steps=3", "train.warmup_steps=0"])
        .words("--stop-at-step 1 --status-every 0")
        .set(TINY)
        .ok();
    // stderr is not a terminal here: a status line instead of a bar.
    let status = String::from_utf8_lossy(&o.stderr);
    assert!(status.contains("1/3 steps loss"), "{status}");
    let o = cli("eval").flag("--run", &part).ok();
    let warned = String::from_utf8_lossy(&o.stderr);
    assert!(
        warned.contains("checkpoint of step 1, before training finished"),
        "{warned}"
    );
    assert_eq!(
        json(&part.join("eval/eval.json"))["report"]["checkpoint_step"],
        1
    );

    // A path that is not UTF-8 survives a resume from before the first checkpoint
    // (init_from.txt keeps its bytes).
    {
        use std::os::unix::ffi::OsStrExt;
        let odd = d.join(std::ffi::OsStr::from_bytes(b"src-\xff"));
        std::fs::create_dir_all(&odd).unwrap();
        std::fs::copy(&ckpt, odd.join("model.safetensors")).unwrap();
        let cont = d.join("cont");
        tiny_train(&d, &data, "cont")
            .flag("--init-from", &odd)
            .words("--stop-at-step 0")
            .set(["train.steps=2", "train.warmup_steps=0"])
            .ok();
        cli("train -q --resume").flag("--out", &cont).ok();
    }

    // Benchmark flags are checked before anything runs or is written.
    let bench_out = d.join("bench");
    let b = bench_out.to_str().unwrap();
    for (flags, needle) in &[
        (vec!["--full-usage", "1.5"], "--full-usage"),
        (vec!["--ste-sample", "0"], "--ste-sample"),
        (
            vec!["--hidden", "100", "--heads", "8"],
            "multiple of --heads",
        ),
        (vec!["--methods", "nope"], "invalid value 'nope'"),
        (vec!["--ppa-power", "2"], "--ppa-power must lie in [0, 1]"),
        (vec!["--peers", "jit"], "--peers takes eager and compile"),
        (vec!["--heads", "0"], "--heads must be at least 1"),
        (vec!["--layers", "0"], "--layers must be at least 1"),
        (vec!["--window", "0"], "--window must be at least 1"),
        (vec!["--steps", "0"], "--steps must be at least 1"),
        (vec!["--lengths", "0"], "--lengths must be at least 1"),
        (vec!["--model", "no-such-model"], "neither a preset"),
        (
            vec!["--model", "qwen2.5-1.5b", "--hidden", "512"],
            "cannot be used with",
        ),
        (
            vec!["--checkpointing", "sometimes"],
            "expected one of `none`, `full`, `selective`, `auto`",
        ),
    ] {
        refused_flags("bench train", b, flags, needle);
    }
    for (flags, needle) in &[
        (vec!["--reps", "0"], "--reps must be at least 1"),
        (vec!["--head-dims", "96"], "--head-dims must be 64 or 128"),
        (vec!["--windows", "0"], "--windows must be at least 1"),
        (vec!["--heads", "0"], "--heads must be at least 1"),
        (
            vec!["--sparsities", "1.5"],
            "--sparsities must lie in [0, 1)",
        ),
        (vec!["--sparsities=-0.5"], "--sparsities must lie in [0, 1)"),
        (
            vec!["--routed-usages", "1.5"],
            "--routed-usages must lie in [0, 1]",
        ),
        (vec!["--lengths", "0"], "--lengths must be at least 1"),
        (vec!["--lengths", "4096,4096"], "--lengths repeats a length"),
        (vec!["--ppa-powers", "2"], "--ppa-powers must lie in [0, 1]"),
    ] {
        refused_flags("bench attention", b, flags, needle);
    }
    for (flags, needle) in &[
        (vec!["--contexts", "0"], "--contexts must be at least 1"),
        (vec!["--batches", "0"], "--batches must be at least 1"),
        (
            vec!["--contexts", "64,128", "--contexts", "64"],
            "--contexts lists 64 twice",
        ),
        (vec!["--short", "1"], "--short must be at least 2"),
        (vec!["--reps", "0"], "--reps must be at least 1"),
        (vec!["--hbm-tbps", "0"], "--hbm-tbps must be a positive"),
        (
            vec!["--full-usage", "1.5"],
            "--full-usage must lie in [0, 1]",
        ),
        (vec!["--ppa-power", "2"], "--ppa-power must lie in [0, 1]"),
        (vec!["--window", "0"], "--window must be at least 1"),
        (vec!["--methods", "nope"], "invalid value 'nope'"),
        (vec!["--model", "no-such-model"], "neither a preset"),
    ] {
        refused_flags("bench decode", b, flags, needle);
    }
    assert!(!bench_out.exists());
}

/// `attnsweep <cmd> --out <out> <flags>` fails with an error containing `needle`.
fn refused_flags(cmd: &str, out: &str, flags: &[&str], needle: &str) {
    let err = flags
        .iter()
        .fold(cli(cmd).flag("--out", out), |c, f| c.arg(f))
        .fails();
    assert!(err.contains(needle), "{cmd} {flags:?}: {err}");
}

/// Mean loss and exact-match accuracy over the in-context recall buckets whose dependency
/// reaches `window` or further, and how many tokens they hold.
fn beyond_window(eval_dir: &Path, window: u32) -> (f64, f64, u64) {
    let mut rdr = csv::Reader::from_path(eval_dir.join("eval_buckets.csv")).unwrap();
    let (mut sum, mut hits, mut n) = (0.0, 0.0, 0u64);
    for row in rdr.records() {
        let row = row.unwrap();
        let (lo, tokens, loss, acc): (u32, u64, f64, f64) = (
            row[1].parse().unwrap(),
            row[2].parse().unwrap(),
            row[3].parse().unwrap(),
            row[4].parse().unwrap(),
        );
        assert!((0.0..=1.0).contains(&acc), "accuracy {acc}");
        if lo >= window && lo != u32::MAX {
            sum += loss * tokens as f64;
            hits += acc * tokens as f64;
            n += tokens;
        }
    }
    (sum / n as f64, hits / n as f64, n)
}

/// The synthetic corpus does what it is for: a full-attention model learns to recall
/// definitions, which a sliding-window model cannot do once they lie beyond its window.
#[test]
fn full_attention_beats_a_window_on_dependencies_beyond_it() {
    let d = scratch("learn");
    let data = d.join("data");
    cli("data synth")
        .flag("--out", &data)
        .words("--train-tokens 300000 --val-tokens 32768 --max-distance 64 --event-rate 0.08")
        .ok();
    let data = format!("data.dir={}", data.display());
    let mut loss = Vec::new();
    for method in ["full", "swa"] {
        let out = d.join(method);
        let method = format!("attention.method={method}");
        cli("train -q")
            .flag("--out", &out)
            .set([&data])
            .set([&method])
            .set([
                "attention.window=8",
                "data.seq_len=64",
                "model.hidden_size=64",
                "model.intermediate_size=128",
                "model.num_hidden_layers=2",
                "train.steps=1500",
                "train.warmup_steps=50",
                "train.lr=5e-3",
                "eval.max_batches=0",
            ])
            .ok();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("eval/eval.json")).unwrap())
                .unwrap();
        let r = &json["report"];
        let (val, unigram) = (
            r["loss"].as_f64().unwrap(),
            r["unigram_entropy"].as_f64().unwrap(),
        );
        assert!(
            val < 0.5 * unigram,
            "{method}: val loss {val} is not far below the unigram entropy {unigram}"
        );
        loss.push(beyond_window(&out.join("eval"), 8));
    }
    let ((full, full_acc, n), (swa, swa_acc, _)) = (loss[0], loss[1]);
    assert!(n > 300, "only {n} tokens depend on keys beyond the window");
    assert!(
        full + 0.5 < swa,
        "full attention ({full:.3}) should beat SWA w=8 ({swa:.3}) on dependencies >= 8 back"
    );
    assert!(
        full_acc > swa_acc + 0.1,
        "full attention should recall more of them: accuracy {full_acc:.3} against {swa_acc:.3}"
    );
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The usage (`mu_f`) an evaluation report records.
fn mu_f_of(eval_json: &Path) -> f64 {
    json(eval_json)["report"]["gates"]["mu_f"].as_f64().unwrap()
}

fn weights(path: &Path) -> std::collections::BTreeMap<String, tch::Tensor> {
    tch::Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

#[test]
fn routed_methods_train_eval_rank_heads_and_prune() {
    let d = scratch("routed");
    let data = synth(&d, 20_000);
    let short = [
        "--set",
        "train.steps=3",
        "--set",
        "train.warmup_steps=1",
        "--set",
        "attention.window=4",
    ];
    train(&d, &data, "base", &short);
    let base = d.join("base");
    let base_s = base.to_str().unwrap();

    // AHA, continued from the full base: gate statistics and the head ranking files.
    let mut aha = short.to_vec();
    aha.extend(["--set", "attention.method=aha", "--init-from", base_s]);
    train(&d, &data, "aha", &aha);
    let ev = d.join("aha/eval");
    for f in ["layer_head_usage.csv", "head_usage.csv", "head_ranking.csv"] {
        assert!(ev.join(f).is_file(), "missing {f}");
    }
    let rep = json(&ev.join("eval.json"))["report"].clone();
    let mu_f = rep["gates"]["mu_f"].as_f64().unwrap();
    assert!(
        mu_f > 0.9,
        "AHA starts from router bias 1 (every gate full): mu_f {mu_f}"
    );
    assert_eq!(rep["gates"]["per_head"].as_array().unwrap().len(), 2);
    assert_eq!(rep["gates"]["need"]["window"], 4);
    assert!(rep["gates"]["need"]["all_gates"]["recall"]
        .as_f64()
        .is_some());
    let log = std::fs::read_to_string(d.join("aha/train_log.csv")).unwrap();
    assert!(log.starts_with("step,loss,lr,grad_norm,tokens_per_s,tokens_seen,reg,mu_f"));
    let last: Vec<&str> = log.lines().last().unwrap().split(',').collect();
    assert!(
        last[6].parse::<f64>().unwrap() > 0.0 && last[7].parse::<f64>().unwrap() > 0.0,
        "{last:?}"
    );

    // Test-time threshold: a higher tau routes fewer gates to the full path.
    let aha_run = d.join("aha");
    cli("eval -q")
        .flag("--run", &aha_run)
        .set(["attention.tau=0.99"])
        .ok();
    let hi = mu_f_of(&aha_run.join("eval-attention.tau_0.99/eval.json"));
    assert!(hi < mu_f, "tau 0.99 gave mu_f {hi}, tau 0.5 gave {mu_f}");

    // Static top-k heads from that ranking, continued from the same base.
    let ranking = ev.join("head_ranking.csv");
    let ranking_set = format!("attention.head_ranking={}", ranking.display());
    let mut st = short.to_vec();
    st.extend([
        "--set",
        "attention.method=static_heads",
        "--set",
        &ranking_set,
        "--set",
        "attention.top_k=3",
        "--init-from",
        base_s,
    ]);
    train(&d, &data, "static", &st);
    let g = mu_f_of(&d.join("static/eval/eval.json"));
    assert!(
        (g - 3.0 / 8.0).abs() < 1e-9,
        "3 of 8 heads always full: mu_f {g}"
    );
    // Ramped along a run's usage (0, 0.2, 0.4 over its three steps: shares 0, 0.5, 1 of its
    // last), the same three heads open 0, then round(1.5) = 2, then 3 of them; evaluated
    // after training, all three.
    let ramp = d.join("ramp_log.csv");
    std::fs::write(&ramp, "step,loss,mu_f\n1,3,0.0\n2,3,0.2\n3,3,0.4\n").unwrap();
    let ramp_set = format!("attention.top_k_ramp={}", ramp.display());
    let mut ramped = st.clone();
    ramped.extend(["--set", &ramp_set, "--set", "train.log_every=1"]);
    train(&d, &data, "ramped", &ramped);
    let log = std::fs::read_to_string(d.join("ramped/train_log.csv")).unwrap();
    let col = log
        .lines()
        .next()
        .unwrap()
        .split(',')
        .position(|c| c == "mu_f");
    let usage: Vec<f64> = (log.lines().skip(1))
        .map(|r| r.split(',').nth(col.unwrap()).unwrap().parse().unwrap())
        .collect();
    assert_eq!(usage, [0.0, 2.0 / 8.0, 3.0 / 8.0], "{log}");
    let g = mu_f_of(&d.join("ramped/eval/eval.json"));
    assert!((g - 3.0 / 8.0).abs() < 1e-9, "after training: mu_f {g}");
    std::fs::write(&ramp, "step,loss,mu_f\n1,3,0.1\n2,3,0.0\n").unwrap();
    let err = ramped
        .iter()
        .fold(tiny_train(&d, &data, "ramped_none"), |c, a| c.arg(a))
        .fails();
    assert!(err.contains("ends at usage 0"), "{err}");
    // AHA started at that static budget: the ranking's first 3 heads' routers open (bias +1),
    // the rest closed (-1); three short steps move them too little to turn a gate.
    let init_set = format!("attention.router_init_heads={}", ranking.display());
    let mut started = short.to_vec();
    started.extend([
        "--set",
        "attention.method=aha",
        "--set",
        &init_set,
        "--set",
        "attention.top_k=3",
        "--init-from",
        base_s,
    ]);
    train(&d, &data, "aha_started", &started);
    let g = mu_f_of(&d.join("aha_started/eval/eval.json"));
    assert!(
        (g - 3.0 / 8.0).abs() < 0.02,
        "AHA started at 3 of 8 heads: mu_f {g}"
    );

    // SwiAttn and the context-free Bernoulli baseline train too.
    let mut sw = short.to_vec();
    sw.extend(["--set", "attention.method=swiattn", "--init-from", base_s]);
    train(&d, &data, "swiattn", &sw);
    let mut be = short.to_vec();
    be.extend([
        "--set",
        "attention.method=l2a",
        "--set",
        "attention.router=bernoulli",
        "--set",
        "attention.bernoulli_p=0.5",
    ]);
    train(&d, &data, "bernoulli", &be);
    let b = mu_f_of(&d.join("bernoulli/eval/eval.json"));
    assert!((b - 0.5).abs() < 0.05, "Bernoulli(0.5) gates: mu_f {b}");

    // L2A from the base with frozen MLPs: the global module starts as a copy of the base
    // attention and the MLP weights do not move. Routers held open for 2 steps: every gate
    // open and the router unchanged until then, learning after.
    let mut l2a = short.to_vec();
    l2a.extend([
        "--set",
        "attention.method=l2a",
        "--set",
        "train.freeze_mlp=true",
        "--set",
        "train.router_hold_steps=2",
        "--set",
        "train.log_every=1",
        "--set",
        "train.ckpt_every=1",
        "--init-from",
        base_s,
    ]);
    train(&d, &data, "l2a", &l2a);
    let bw = weights(&base.join("checkpoints/step_00000003/model.safetensors"));
    let lw = weights(&d.join("l2a/checkpoints/step_00000003/model.safetensors"));
    let held = weights(&d.join("l2a/checkpoints/step_00000002/model.safetensors"));
    let router = "model.layers.1.self_attn.router.weight";
    assert_eq!(
        held[router].abs().sum(tch::Kind::Float).double_value(&[]),
        0.0
    );
    assert!(lw[router].abs().sum(tch::Kind::Float).double_value(&[]) > 0.0);
    let log = std::fs::read_to_string(d.join("l2a/train_log.csv")).unwrap();
    let mu_f: Vec<f64> = log
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(7).unwrap().parse().unwrap())
        .collect();
    assert_eq!(mu_f[..2], [1.0, 1.0], "{log}");
    assert!(lw["model.layers.1.mlp.up_proj.weight"].equal(&bw["model.layers.1.mlp.up_proj.weight"]));
    assert!(lw["model.embed_tokens.weight"].equal(&bw["model.embed_tokens.weight"]));
    assert!(!lw["model.layers.1.self_attn.q_proj.weight"]
        .equal(&bw["model.layers.1.self_attn.q_proj.weight"]));
    assert!(lw.contains_key("model.layers.1.self_attn.global_attn.q_proj.weight"));

    // Pruning every layer (threshold 0) leaves window-only caches and a loadable model.
    let l2a_run = d.join("l2a");
    let pruned = d.join("pruned");
    let o = cli("prune")
        .flag("--run", &l2a_run)
        .words("--threshold 0")
        .flag("--out", &pruned)
        .ok();
    assert!(String::from_utf8_lossy(&o.stdout).contains("pruned layers [0, 1]"));
    let p = json(&pruned.join("prune.json"));
    // 2 layers x 4 positions x (k, v) x 4 heads x 8 dims x 4 bytes.
    assert_eq!(
        p["kv_cache_bytes_after"].as_f64().unwrap(),
        2.0 * 4.0 * 2.0 * 4.0 * 8.0 * 4.0
    );
    assert!(
        p["kv_cache_bytes_before"].as_f64().unwrap() > p["kv_cache_bytes_full"].as_f64().unwrap()
    );
    assert!(!weights(&pruned.join("model.safetensors"))
        .keys()
        .any(|k| k.contains("global_attn")));
    cli("eval -q").flag("--run", &pruned).ok();
    let err = cli("prune")
        .flag("--run", &l2a_run)
        .flag("--out", &pruned)
        .fails();
    assert!(err.contains("already holds a model"), "{err}");
    let err = cli("prune").flag("--run", base_s).fails();
    assert!(
        err.contains("attention.method = \"full\"") && err.contains("method \"l2a\" only"),
        "{err}"
    );
}

/// A grid's base for tiny CPU cells on the data set at `data`.
fn status(cell: &Path) -> serde_json::Value {
    json(&cell.join("status.json"))
}

fn cell_dirs(out: &Path, stage: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("{stage}-"))
        })
        .collect();
    v.sort();
    v
}

/// On GPUs, a sweep refuses a slot whose ranks cannot share out a train cell's micro-batches
/// before any cell runs, naming the cell and the option to change.
#[test]
fn sweep_refuses_slots_that_cannot_share_a_step() {
    let d = scratch("slots");
    let grid = tiny_grid(&d, "", "");
    let out = d.join("out");
    let err = cli("sweep")
        .flag("--grid", grid.to_str().unwrap())
        .flag("--out", out.to_str().unwrap())
        .words("--devices 0,1 --gpus-per-cell 2")
        .fails();
    assert!(
        err.contains("train.grad_accum = 1")
            && err.contains("cannot share out evenly")
            && err.contains("--gpus-per-cell"),
        "{err}"
    );
    assert!(!out.exists(), "nothing is written");
}

#[test]
fn sweep_isolates_failures_skips_finished_cells_and_reruns_failed_ones() {
    let d = scratch("sweep");
    let ranking = d.join("ranking.csv");
    let grid = tiny_grid(
        &d,
        "",
        &format!(
            "[[stage]]\nname = \"heads\"\ninit_from = \"base\"\nset = {{ \"attention.method\" = \"static_heads\", \"attention.top_k\" = 1, \"attention.head_ranking\" = \"{}\" }}\n\
             [[stage]]\nname = \"random\"\ninit_from = \"base\"\nreads = \"aha\"\nmatch_usage = true\n\
             set = {{ \"attention.method\" = \"aha\", \"attention.router\" = \"bernoulli\" }}\n\
             axes = {{ \"attention.window\" = [4] }}\n\
             [[stage]]\nname = \"ranked\"\ninit_from = \"base\"\nreads = \"aha\"\n\
             set = {{ \"attention.method\" = \"static_heads\", \"attention.top_k\" = 1, \"attention.head_ranking\" = \"{{reads}}/eval/head_ranking.csv\" }}\n\
             axes = {{ \"attention.window\" = [8] }}\n\
             [[stage]]\nname = \"again\"\nkind = \"eval\"\nof = \"ranked\"\n",
            ranking.display()
        ),
    );
    let out = d.join("out");
    let (g, o) = (grid.to_str().unwrap(), out.to_str().unwrap());
    let listing = String::from_utf8_lossy(
        &cli("sweep")
            .flag("--grid", g)
            .flag("--out", o)
            .words("--dry-run")
            .ok()
            .stdout,
    )
    .into_owned();
    assert!(listing.starts_with("7 cells in 6 stages"), "{listing}");
    assert_eq!(listing.matches("pending").count(), 7);

    // The static_heads cell fails (its ranking file does not exist yet); the others finish.
    let err = cli("sweep")
        .flag("--grid", g)
        .flag("--out", o)
        .words("--quiet")
        .fails();
    assert!(err.contains("1 cells failed"), "{err}");
    let heads = cell_dirs(&out, "heads").remove(0);
    let st = status(&heads);
    assert_eq!(st["state"], "failed");
    assert!(
        st["error"].as_str().unwrap().contains("ranking.csv"),
        "{st}"
    );
    let aha = cell_dirs(&out, "aha");
    assert_eq!(aha.len(), 2);
    for c in &aha {
        assert_eq!(status(c)["state"], "done");
    }
    // Bernoulli gates drawn at the usage the read AHA cell (window 4) measured.
    let random = cell_dirs(&out, "random").remove(0);
    assert_eq!(status(&random)["state"], "done");
    let aha4 = aha
        .iter()
        .find(|c| json(&c.join("cell.json"))["settings"]["attention.window"] == 4)
        .unwrap();
    let mu_f = mu_f_of(&aha4.join("eval/eval.json"));
    let drawn = json(&random.join("eval/eval.json"))["config"]["attention"]["bernoulli_p"]
        .as_f64()
        .unwrap();
    assert_eq!(drawn, mu_f);
    // An evaluation of a cell whose ranking path named {reads} evaluates the path that cell
    // resolved.
    let again = cell_dirs(&out, "again").remove(0);
    assert_eq!(status(&again)["state"], "done", "{}", status(&again));
    for f in ["summary.csv", "tidy.csv", "aha_windows.csv", "cells.json"] {
        assert!(out.join(f).is_file(), "missing {f}");
    }
    assert_eq!(
        std::fs::read_to_string(out.join("aha_windows.csv"))
            .unwrap()
            .lines()
            .count(),
        3
    );

    // A rerun skips finished cells and, without --retry-failed, leaves the failure alone,
    // and says so by failing: the sweep is still incomplete.
    let ckpt = aha[0].join("checkpoints/step_00000003/model.safetensors");
    let before = std::fs::metadata(&ckpt).unwrap().modified().unwrap();
    let err = cli("sweep")
        .flag("--grid", g)
        .flag("--out", o)
        .words("--quiet")
        .fails();
    assert!(
        err.contains("1 cells failed") && err.contains("0 failed, 7 skipped"),
        "{err}"
    );
    assert_eq!(
        std::fs::metadata(&ckpt).unwrap().modified().unwrap(),
        before
    );
    assert_eq!(status(&heads)["state"], "failed");
    // Once the cause is fixed, --retry-failed finishes the sweep; its stderr is not a
    // terminal, so it reports in status lines.
    std::fs::write(&ranking, "rank,layer,head,mu_f\n1,0,0,0.9\n").unwrap();
    let retried = cli("sweep")
        .flag("--grid", g)
        .flag("--out", o)
        .words("--retry-failed --status-every 0")
        .ok();
    let lines = String::from_utf8_lossy(&retried.stderr);
    assert!(
        lines.contains("cells: 6 done, 0 failed, 1 left of 7; running: heads-"),
        "{lines}"
    );
    let st = status(&heads);
    assert_eq!(
        (
            st["state"].as_str().unwrap(),
            st["attempts"].as_u64().unwrap()
        ),
        ("done", 2)
    );
    assert_eq!(
        std::fs::metadata(&ckpt).unwrap().modified().unwrap(),
        before
    );

    // Tables and figures from the sweep directory.
    let figs = String::from_utf8_lossy(&cli("plot").flag("--sweep", o).ok().stdout).into_owned();
    for f in [
        "figures/mu_f_vs_window.png",
        "figures/mu_f_vs_window.svg",
        "figures/head_usage_sorted.png",
        "figures/pareto.png",
    ] {
        assert!(out.join(f).is_file(), "missing {f} in:\n{figs}");
    }

    // Slurm: one array per stage, each task one cell.
    cli("sweep")
        .flag("--grid", g)
        .flag("--out", o)
        .words("--emit slurm")
        .ok();
    let aha_script = std::fs::read_to_string(out.join("slurm/aha.sbatch")).unwrap();
    assert!(
        aha_script.contains("#SBATCH --array=1-2")
            && aha_script.contains("--cell \"$SLURM_ARRAY_TASK_ID\""),
        "{aha_script}"
    );
    assert!(std::fs::read_to_string(out.join("slurm/submit.sh"))
        .unwrap()
        .contains("--dependency=afterany"));
}

/// A dry run refuses what the run would, before anything is written: a cell index past the
/// grid, slots that --devices cannot hold.
#[test]
fn a_dry_run_refuses_cells_past_the_grid_and_slots_that_do_not_fit() {
    let d = scratch("sweep-refused");
    let grid = tiny_grid(&d, "", "");
    let out = d.join("out");
    let (g, o) = (grid.to_str().unwrap(), out.to_str().unwrap());
    let refused = |words: &str| {
        cli("sweep")
            .flag("--grid", g)
            .flag("--out", o)
            .words(words)
            .fails()
    };
    let err = refused("--cell 999 --dry-run");
    assert!(err.contains("--cell 999: the grid has"), "{err}");
    let err = refused("--devices 0 --gpus-per-cell 2 --dry-run");
    assert!(err.contains("--gpus-per-cell 2 does not divide"), "{err}");
    let err = refused("--devices 0 --gpus-per-cell 0 --dry-run");
    assert!(err.contains("at least 1"), "{err}");
}

#[test]
fn sweep_resumes_an_interrupted_cell_and_two_runners_never_run_a_cell_twice() {
    let d = scratch("sweep2");
    let grid = tiny_grid(&d, "", "");
    let out = d.join("out");
    let (g, o) = (grid.to_str().unwrap(), out.to_str().unwrap());
    // Run the base cell alone, then interrupt an AHA cell half way, as a killed runner would.
    cli("sweep")
        .flag("--grid", g)
        .flag("--out", o)
        .words("--cell 0 --quiet")
        .ok();
    let err = cli("sweep")
        .flag("--grid", g)
        .flag("--out", o)
        .words("--quiet --cell 9")
        .fails();
    assert!(err.contains("--cell 9"), "{err}");
    let base = cell_dirs(&out, "base").remove(0);
    assert_eq!(status(&base)["state"], "done");
    let cells: serde_json::Value = json(&out.join("cells.json"));
    let victim = out.join(cells[1]["id"].as_str().unwrap());
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("cell.toml"), toml_of(&cells[1]["config"])).unwrap();
    cli("train -q")
        .flag("--out", &victim)
        .flag("--config", &victim.join("cell.toml"))
        .flag("--init-from", &base)
        .words("--stop-at-step 1")
        .ok();
    std::fs::write(
        victim.join("status.json"),
        r#"{"state":"running","attempts":1,"error":null}"#,
    )
    .unwrap();

    // Two runners at once share the remaining cells.
    let spawn = || {
        bin()
            .args(["sweep", "--grid", g, "--out", o, "--quiet"])
            .spawn()
            .unwrap()
    };
    let (mut a, mut b) = (spawn(), spawn());
    assert!(a.wait().unwrap().success() && b.wait().unwrap().success());
    for c in cell_dirs(&out, "aha") {
        let st = status(&c);
        assert_eq!(st["state"], "done");
        let want = if c == victim { 2 } else { 1 };
        assert_eq!(
            st["attempts"].as_u64().unwrap(),
            want,
            "{} ran {} times",
            c.display(),
            st["attempts"]
        );
    }
    // The interrupted cell continued from its checkpoint instead of starting over.
    let log = std::fs::read_to_string(victim.join("log.txt")).unwrap();
    assert!(log.is_empty() || !log.contains("error"), "{log}");
    let steps: Vec<String> = log_rows(&victim.join("train_log.csv"))
        .into_iter()
        .map(|r| r[0].clone())
        .collect();
    assert_eq!(steps, ["1", "2", "3"]);
    assert!(victim.join("checkpoints/step_00000003").is_dir());
}

/// The config object of cells.json back as TOML.
fn toml_of(v: &serde_json::Value) -> String {
    let cfg: attnsweep::config::Config = serde_json::from_value(v.clone()).unwrap();
    cfg.to_toml()
}

/// A tokenizer.json made here: a word-level vocabulary with whitespace pre-tokenisation and
/// an end-of-document token.
fn word_tokenizer(path: &Path) {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    let words = [
        "[UNK]", "</s>", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", ".",
    ];
    let vocab = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect();
    let model = WordLevel::builder()
        .vocab(vocab)
        .unk_token("[UNK]".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    tok.save(path, false).unwrap();
}

/// In `d`: the word-level `tokenizer.json`, a text of its words and the data set prepared from
/// it (a fifth held out), as (tokenizer, text, data set).
fn word_data_set(d: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let tj = d.join("tokenizer.json");
    word_tokenizer(&tj);
    let text = d.join("a.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog . ".repeat(100),
    )
    .unwrap();
    let ds = d.join("ds");
    cli("data prepare")
        .flag("--input", &text)
        .flag("--out", &ds)
        .words("--val-fraction 0.2")
        .flag("--tokenizer", &tj)
        .ok();
    (tj, text, ds)
}

#[test]
fn data_prepare_with_a_tokenizer_json() {
    let d = scratch("tok");
    let (tj, text, ds) = word_data_set(&d);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ds.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["vocab_size"], 11);
    assert_eq!(meta["eot_token"], 1, "</s> ends documents");
    assert_eq!(meta["tokenizer"], "tokenizer.json");
    assert!(
        ds.join("tokenizer.json").is_file(),
        "the data set keeps its tokenizer"
    );
    // 10 words per repetition, 100 repetitions, one end-of-document token.
    assert_eq!(
        meta["train_tokens"].as_u64().unwrap() + meta["val_tokens"].as_u64().unwrap(),
        1001
    );
    let data = format!("data.dir={}", ds.display());
    train(
        &d,
        &data,
        "run",
        &[
            "--set",
            "train.steps=2",
            "--set",
            "train.warmup_steps=0",
            "--set",
            "data.seq_len=32",
        ],
    );
    let cfg = std::fs::read_to_string(d.join("run/config.toml")).unwrap();
    assert!(cfg.contains("vocab_size = 11"));
    // Multiple choice alone needs no data set: a model folder with its tokenizer beside it
    // (as a converted model keeps it) is scored, without a loss; without one, a clear error.
    let model = d.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let ds_line = format!("dir = {:?}", ds.display().to_string());
    std::fs::write(
        model.join("config.toml"),
        cfg.replace(&ds_line, "dir = \"\""),
    )
    .unwrap();
    let weights = std::fs::read_dir(d.join("run/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap()
        .join("model.safetensors");
    std::fs::copy(weights, model.join("model.safetensors")).unwrap();
    let mc = d.join("mc.jsonl");
    std::fs::write(
        &mc,
        "{\"context\": \"the quick\", \"choices\": [\" brown\", \" dog\"], \"gold\": 0}\n",
    )
    .unwrap();
    let err = cli("eval").flag("--run", &model).flag("--mc", &mc).fails();
    assert!(err.contains("holds no tokenizer.json"), "{err}");
    std::fs::copy(&tj, model.join("tokenizer.json")).unwrap();
    cli("eval -q").flag("--run", &model).flag("--mc", &mc).ok();
    let results = model.join("eval-tasks/results.json");
    assert!(results.is_file() && !model.join("eval-tasks/eval.json").exists());
    // A file that is not a tokenizer is a clear error.
    let err = cli("data prepare")
        .flag("--input", &text)
        .flag("--out", &d.join("x"))
        .flag("--tokenizer", &text)
        .fails();
    assert!(err.contains("is not a readable tokenizer.json"), "{err}");
}

/// A trained model of every method, exported, is scored by lm-evaluation-harness itself from
/// the folder as it is (its `hf` model with `trust_remote_code`, a multiple-choice task over a
/// local file), and every log-likelihood it gives is ours (`eval --mc`) within 1e-4.
#[test]
fn lm_evaluation_harness_scores_every_exported_method() {
    let d = scratch("lmeval");
    let (_, _, ds) = word_data_set(&d);
    let mc = d.join("mc.jsonl");
    std::fs::write(
        &mc,
        [
            r#"{"context": "the quick", "choices": ["brown", "dog", "fox"], "gold": 0}"#,
            r#"{"context": "the lazy", "choices": ["fox", "dog"], "gold": 1}"#,
            r#"{"context": "jumps over the", "choices": ["lazy dog", "quick fox ."], "gold": 0}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let data = format!("data.dir={}", ds.display());
    let methods = [
        "full",
        "swa",
        "ppa",
        "static_hybrid",
        "sinks",
        "aha",
        "l2a",
        "swiattn",
    ];
    let mut exported = Vec::new();
    for m in methods {
        let run = d.join(format!("run-{m}"));
        let method = format!("attention.method={m}");
        train(
            &d,
            &data,
            run.file_name().unwrap().to_str().unwrap(),
            &[
                "--set",
                &method,
                "--set",
                "attention.window=3",
                "--set",
                "train.steps=3",
            ],
        );
        cli("eval -q --log-samples")
            .flag("--run", &run)
            .flag("--mc", &mc)
            .flag("--out", run.join("mc"))
            .ok();
        let hf = d.join(format!("hf-{m}"));
        cli("export").flag("--run", &run).flag("--out", &hf).ok();
        exported.push((m, run, hf));
    }
    // The task as the harness's config states a multiple-choice task over a local file (its
    // `simple_evaluate` cannot yet print a task from outside its own folder, so the task and
    // the model go to `evaluate` directly).
    let script = r#"
import json, sys
from lm_eval.api.task import ConfigurableTask
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
config = {"task": "attnsweep_mc", "dataset_path": "json",
          "dataset_kwargs": {"data_files": {"test": sys.argv[1]}}, "test_split": "test",
          "output_type": "multiple_choice", "doc_to_text": "{{context}}",
          "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}", "target_delimiter": " ",
          "metric_list": [{"metric": "acc"}]}
for path in sys.argv[2:]:
    lm = HFLM(pretrained=path, trust_remote_code=True, dtype="float32", batch_size=1, device="cpu")
    r = evaluate(lm=lm, task_dict={"attnsweep_mc": ConfigurableTask(config=config)}, log_samples=True)
    docs = sorted(r["samples"]["attnsweep_mc"], key=lambda s: s["doc_id"])
    json.dump([[resp[0][0] for resp in s["resps"]] for s in docs], open(path + "/lm_eval.json", "w"))
"#;
    let py = std::env::var("ATTNSWEEP_PYTHON").unwrap_or_else(|_| "python3".into());
    let cache = d.join("hf-cache");
    let o = std::process::Command::new(py)
        .args(["-c", script])
        .arg(&mc)
        .args(exported.iter().map(|e| &e.2))
        .env("HF_HOME", &cache)
        .env("HF_DATASETS_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for (m, run, hf) in &exported {
        let theirs: Vec<Vec<f64>> =
            serde_json::from_str(&std::fs::read_to_string(hf.join("lm_eval.json")).unwrap())
                .unwrap();
        let ours: Vec<Vec<f64>> = std::fs::read_to_string(run.join("mc/samples_mc.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["filtered_resps"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| r[0].as_f64().unwrap())
                    .collect()
            })
            .collect();
        let shape = |v: &Vec<Vec<f64>>| v.iter().map(Vec::len).collect::<Vec<_>>();
        assert_eq!(
            (shape(&theirs), shape(&ours)),
            (vec![3, 2, 2], vec![3, 2, 2]),
            "{m}"
        );
        for (a, b) in theirs.iter().flatten().zip(ours.iter().flatten()) {
            assert!(
                (a - b).abs() < 1e-4 * b.abs().max(1.0),
                "{m}: harness {a}, ours {b}"
            );
        }
    }
}

/// Probe documents train a byte-level model; `eval --tasks --mc` then writes the
/// harness-shaped results, the tidy rows, the NIAH grid, the efficiency table and the
/// samples, for a static and a routed method; bad task input fails clearly.
#[test]
fn probes_and_multiple_choice_evaluate_end_to_end() {
    let dir = scratch("tasks");
    let data = dir.join("probes");
    cli("data probes").flag("--out", &data).words("--tasks niah_single,passkey --lengths 96,128 --digits 3 --train-docs 200 --val-docs 20").ok();
    let mc = dir.join("toy_mc.jsonl");
    std::fs::write(
        &mc,
        "{\"context\": \"The grass is\", \"choices\": [\"green\", \"blue\"], \"gold\": 0}\n{\"context\": \"The sky is\", \"choices\": [\"green\", \"blue\"], \"gold\": 1}\n",
    )
    .unwrap();
    let data_set = format!("data.dir={}", data.display());
    for method in ["swa", "aha"] {
        let out = dir.join(method);
        let method_set = format!("attention.method={method}");
        train(
            &dir,
            &data_set,
            out.to_str().unwrap(),
            &[
                "--set",
                "data.seq_len=128",
                "--set",
                &method_set,
                "--set",
                "attention.window=8",
                "--set",
                "train.steps=20",
                "--set",
                "train.warmup_steps=2",
            ],
        );
        let ev = dir.join(format!("{method}-eval"));
        let o = cli("eval")
            .flag("--run", &out)
            .flag("--out", &ev)
            .words("--tasks niah_single,mqar")
            .flag("--mc", &mc)
            .set([
                "eval.lengths=[96,128]",
                "eval.depths=[0.0,1.0]",
                "eval.samples=3",
                "eval.digits=3",
                "eval.queries=1",
            ])
            .words("--log-samples")
            .ok();
        assert!(String::from_utf8_lossy(&o.stdout).contains("toy_mc"));
        // One line per item, as the harness logs samples: each choice's log-likelihood and
        // whether it is the greedy continuation, the prediction, the gold.
        let logged = std::fs::read_to_string(ev.join("samples_toy_mc.jsonl")).unwrap();
        let first: serde_json::Value =
            serde_json::from_str(logged.lines().next().unwrap()).unwrap();
        assert_eq!(logged.lines().count(), 2);
        assert_eq!(first["resps"].as_array().unwrap().len(), 2);
        assert!(first["filtered_resps"][0][1].is_boolean() && first["prediction"].is_u64());
        let r = json(&ev.join("results.json"));
        for (task, metric) in [
            ("niah_single", "exact_match,none"),
            ("mqar", "recall,none"),
            ("toy_mc", "acc_norm,none"),
        ] {
            let v = r["results"][task][metric].as_f64().unwrap_or(f64::NAN);
            assert!((0.0..=1.0).contains(&v), "{task} {metric}: {v}");
        }
        assert_eq!(r["n-samples"]["niah_single"]["effective"], 6);
        assert_eq!(r["n-samples"]["mqar"]["effective"], 6);
        assert_eq!(r["n-samples"]["toy_mc"]["effective"], 2);
        assert_eq!(
            r["results"]["niah_single"]["full_ratio,none"].is_f64(),
            method == "aha"
        );
        // AHA's usage per task, layer and head over the probes' prompts (AHA Fig. 3 per
        // task): the tiny model has 2 layers of 4 heads.
        let usage = ev.join("probe_head_usage.csv");
        assert_eq!(usage.is_file(), method == "aha");
        if method == "aha" {
            let rows = log_rows(&usage);
            assert_eq!(rows.len(), 2 * 2 * 4);
            assert!(rows.iter().all(|r| {
                let mu: f64 = r[3].parse().unwrap();
                (r[0] == "mqar" || r[0] == "niah_single") && (0.0..=1.0).contains(&mu)
            }));
        }
        let niah = std::fs::read_to_string(ev.join("niah.csv")).unwrap();
        assert!(niah.starts_with("depth,length,accuracy,full_ratio\n"));
        assert_eq!(niah.lines().count(), 1 + 4, "{niah}");
        let eff = log_rows(&ev.join("efficiency.csv"));
        assert_eq!(eff.len(), 2, "two lengths");
        // SWA attends at most w keys per query: 96 positions of window 8 average 7.625.
        if method == "swa" {
            let keys: f64 = eff[0][2].parse().unwrap();
            assert!((keys - (8.0 * 96.0 - 28.0) / 96.0).abs() < 1e-9, "{keys}");
        }
        let samples = common::probe_samples(&ev);
        assert_eq!(samples.lines().count(), 6 + 6);
        let tidy = std::fs::read_to_string(ev.join("tasks.csv")).unwrap();
        assert!(tidy.starts_with("task,length,depth,metric,value,n,ci95_low,ci95_high\n"));
        // Every interval lies inside [0, 1] and holds its score.
        for line in tidy.lines().skip(1) {
            let f: Vec<&str> = line.split(',').collect();
            let (v, lo, hi): (f64, f64, f64) = (
                f[4].parse().unwrap(),
                f[6].parse().unwrap(),
                f[7].parse().unwrap(),
            );
            assert!((0.0..=v).contains(&lo) && (v..=1.0).contains(&hi), "{line}");
        }
    }
    let swa = dir.join("swa");
    let run_dir = swa.to_str().unwrap();

    // Without --out, task results go beside the training's report, never over it; the
    // probes default to the digits the data set's probe documents were written with (3).
    let report = std::fs::read(swa.join("eval/eval.json")).unwrap();
    cli("eval -q")
        .flag("--run", run_dir)
        .words("--tasks passkey")
        .set(["eval.samples=2", "eval.depths=[0.5]"])
        .ok();
    assert_eq!(std::fs::read(swa.join("eval/eval.json")).unwrap(), report);
    let tasks_dir = swa.join("eval-eval.samples_2_eval.depths__0.5_-tasks");
    let probes = common::probe_samples(&tasks_dir);
    for line in probes.lines() {
        let target = serde_json::from_str::<serde_json::Value>(line).unwrap()["target"]
            .as_str()
            .unwrap()
            .trim()
            .to_string();
        assert_eq!(target.len(), 3, "{target:?}");
    }
    // A multiple-choice file whose name is not UTF-8 is read from its own path.
    {
        use std::os::unix::ffi::OsStrExt;
        let odd = dir.join(std::ffi::OsStr::from_bytes(b"mc-\xff.jsonl"));
        std::fs::copy(&mc, &odd).unwrap();
        cli("eval -q")
            .flag("--run", run_dir)
            .flag("--out", dir.join("odd-eval"))
            .flag("--mc", &odd)
            .ok();
    }
    // Prompts of a million tokens are refused with the memory they would take.
    assert!(cli("eval")
        .flag("--run", run_dir)
        .words("--tasks niah_single")
        .set(["eval.lengths=[1000000]"])
        .fails()
        .contains("GiB of memory"));
    assert!(cli("eval")
        .flag("--run", run_dir)
        .words("--tasks needle")
        .fails()
        .contains("unknown probe task"));
    // RULER's tasks under their names: scored by string match, the effective length in
    // ruler.csv and results.json; the essay tasks ask for a text haystack.
    let ruler_dir = dir.join("ruler-eval");
    cli("eval -q")
        .flag("--run", run_dir)
        .flag("--out", &ruler_dir)
        .words("--tasks niah_single_1,niah_multikey_2,vt,cwe,fwe")
        .set([
            "eval.lengths=[600,800]",
            "eval.samples=1",
            "eval.depths=[0.5]",
        ])
        .ok();
    let r = json(&ruler_dir.join("results.json"));
    for task in ["niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe"] {
        let v = r["results"][task]["recall,none"]
            .as_f64()
            .unwrap_or(f64::NAN);
        assert!((0.0..=1.0).contains(&v), "{task}: {v}");
    }
    let rows = log_rows(&ruler_dir.join("ruler.csv"));
    assert_eq!(
        rows.iter().map(|r| r[0].as_str()).collect::<Vec<_>>(),
        ["600", "800"]
    );
    assert!(
        r["results"]["ruler"]["effective_length,none"].is_f64(),
        "{}",
        r["results"]["ruler"]
    );
    assert!(cli("eval")
        .flag("--run", run_dir)
        .words("--tasks niah_single_2")
        .set(["eval.lengths=[400]"])
        .fails()
        .contains("eval.haystack = \"text\""));
    assert!(cli("eval")
        .flag("--run", run_dir)
        .words("--tasks vt")
        .set(["eval.chat=true"])
        .fails()
        .contains("chat template"));
    assert!(cli("eval")
        .flag("--run", run_dir)
        .words("--tasks niah_single")
        .set(["eval.lengths=[40]"])
        .fails()
        .contains("too short"));
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"context\": \"a\"}\n").unwrap();
    assert!(cli("eval")
        .flag("--run", run_dir)
        .flag("--mc", &bad)
        .fails()
        .contains("bad.jsonl line 1"));
}

/// Every committed grid expands: its stages, axes, references and [corpus]/[synth] sections are
/// valid and it names its cells, without preparing data or training.
#[test]
fn every_committed_grid_dry_runs() {
    let d = scratch("grids");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("sweeps");
    let mut grids: Vec<PathBuf> = ["", "gpu"]
        .iter()
        .flat_map(|sub| std::fs::read_dir(root.join(sub)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    grids.sort();
    assert!(grids.len() >= 8, "{grids:?}");
    for g in &grids {
        let out = d.join(g.file_stem().unwrap());
        let o = cli("sweep")
            .flag("--grid", &g)
            .flag("--out", &out)
            .words("--dry-run")
            .run();
        // A grid's pretrained model is made by `make pretrained`, which a fresh clone has not
        // run: then its absence must be the dry run's only objection.
        let grid: toml::Table = toml::from_str(&std::fs::read_to_string(g).unwrap()).unwrap();
        let absent = grid
            .get("pretrained")
            .and_then(|p| p.as_str())
            .is_some_and(|p| !Path::new(env!("CARGO_MANIFEST_DIR")).join(p).is_dir());
        let err = String::from_utf8_lossy(&o.stderr);
        if absent {
            let reasons: Vec<&str> = err.lines().skip(1).collect();
            assert!(
                !o.status.success()
                    && !reasons.is_empty()
                    && reasons
                        .iter()
                        .all(|l| l.contains("pretrained model") && l.contains("does not exist")),
                "{}: {err}",
                g.display()
            );
        } else {
            assert!(o.status.success(), "{}: {err}", g.display());
        }
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains(" cells in "), "{}: {text}", g.display());
        assert!(
            text.contains("M training tokens in all"),
            "{}: {text}",
            g.display()
        );
        assert!(
            !out.exists(),
            "{}: a dry run wrote {}",
            g.display(),
            out.display()
        );
    }
}

/// A reader that stops reading (`attnsweep ... | head`) ends the command quietly, as a Unix
/// tool ends on SIGPIPE, with no report of an internal error.
#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    let grid = Path::new(env!("CARGO_MANIFEST_DIR")).join("sweeps/gpu/l2a_pretrained.toml");
    let out = scratch("closed-pipe").join("out");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = bin()
        .args([
            "sweep",
            "--grid",
            grid.to_str().unwrap(),
            "--dry-run",
            "--out",
        ])
        .arg(&out)
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(141), "{err}");
    assert!(
        !err.contains("internal error") && !err.contains("panicked"),
        "{err}"
    );
    assert!(err.contains("standard output was closed"), "{err}");
}

/// The reproduction path on the CPU in miniature: a directory of plain text, gzip JSON Lines,
/// Parquet, xz text and one binary file becomes a corpus through a grid's [corpus]; the grid
/// trains a base, evaluates it windowed and continues it windowed; the tables and figures follow.
#[test]
fn harness_prepares_mixed_files_trains_tables_and_figures() {
    use std::io::Write;
    let d = scratch("harness");
    let src = d.join("corpus");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    let doc = |i: usize| format!("def f{i}(x):\n    return x * {i} + f{}(x)\n", i + 1).repeat(40);
    std::fs::write(src.join("a.txt"), doc(0)).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    for i in 1..4 {
        writeln!(gz, "{}", serde_json::json!({ "text": doc(i) })).unwrap();
    }
    std::fs::write(src.join("b.jsonl.gz"), gz.finish().unwrap()).unwrap();
    let rows: Vec<String> = (4..6).map(doc).collect();
    let mut df = polars::prelude::DataFrame::new_infer_height(vec![polars::prelude::Column::new(
        "text".into(),
        rows,
    )])
    .unwrap();
    let mut parquet = Vec::new();
    polars::prelude::ParquetWriter::new(&mut parquet)
        .finish(&mut df)
        .unwrap();
    std::fs::write(src.join("c.parquet"), parquet).unwrap();
    let mut xz = liblzma::write::XzEncoder::new(Vec::new(), 6);
    xz.write_all(doc(6).as_bytes()).unwrap();
    std::fs::write(src.join("sub/d.txt.xz"), xz.finish().unwrap()).unwrap();
    std::fs::write(src.join("e.bin"), b"\x7fELF\x00\x01\x02").unwrap();

    let data = d.join("data");
    let grid = d.join("grid.toml");
    std::fs::write(
        &grid,
        format!(
            r#"
name = "harness"
[corpus]
input = ["{src}"]
val_fraction = 0.2
{base}
[[stage]]
name = "base"
set = {{ "attention.method" = "full", "train.eval_every" = 2 }}
[[stage]]
name = "full"
init_from = "base"
set = {{ "attention.method" = "full" }}
[[stage]]
name = "swa_zs"
kind = "eval"
of = "base"
set = {{ "attention.method" = "swa", "attention.window" = 8 }}
[[stage]]
name = "swa_cpt"
init_from = "base"
set = {{ "attention.method" = "swa", "attention.window" = 8 }}
[[stage]]
name = "aha"
init_from = "base"
set = {{ "attention.method" = "aha", "attention.window" = 8 }}
[[stage]]
name = "probes"
kind = "eval"
of = "aha"
set = {{ "eval.tasks" = ["passkey"], "eval.lengths" = [96], "eval.samples" = 2 }}
"#,
            src = src.display(),
            base = tiny_base(&data)
        ),
    )
    .unwrap();
    let out = d.join("sweep");
    sweep(&grid, &out, &[]);
    let corpus = &json(&data.join("meta.json"))["corpus"];
    assert_eq!(corpus["files"], 4, "{corpus}");
    assert_eq!(corpus["documents"], 7, "{corpus}");
    assert_eq!(corpus["skipped_files"], 1, "{corpus}");
    assert_eq!(corpus["tokens_sha256"].as_str().unwrap().len(), 64);

    cli("plot").flag("--sweep", &out).ok();
    let summary = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    let header: Vec<&str> = summary.lines().next().unwrap().split(',').collect();
    let (cell, rate, retain) = (
        header.iter().position(|c| *c == "cell").unwrap(),
        header.iter().position(|c| *c == "tokens_per_s").unwrap(),
        header.iter().position(|c| *c == "retain_pct").unwrap(),
    );
    let rows: Vec<Vec<&str>> = summary
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 6, "{summary}");
    for r in &rows {
        let trained = !r[cell].starts_with("swa_zs-") && !r[cell].starts_with("probes-");
        assert_eq!(!r[rate].is_empty(), trained, "{summary}");
        let pct: f64 = r[retain].parse().unwrap();
        assert!(pct.is_finite() && pct > 0.0, "{summary}");
    }
    // The AHA cell's usage map on its own data and, evaluated on probes, on their prompts.
    let probes = rows
        .iter()
        .find(|r| r[cell].starts_with("probes-"))
        .unwrap()[cell];
    let aha = rows.iter().find(|r| r[cell].starts_with("aha-")).unwrap()[cell];
    let maps = [
        format!("head_usage_{aha}"),
        format!("head_usage_{probes}_passkey"),
    ];
    for f in ["loss_curves", "pareto"]
        .iter()
        .map(|s| s.to_string())
        .chain(maps)
    {
        for ext in ["png", "svg"] {
            let p = out.join("figures").join(format!("{f}.{ext}"));
            assert!(std::fs::metadata(&p).unwrap().len() > 0, "{}", p.display());
        }
    }
}

/// A grid with `seeds = 2` trains each cell twice, continued cells from the base of their own
/// seed, and `plot` summarises each setting over its seeds (`replicates.csv`) and compares the
/// settings of a stage (`replicate_differences.csv`). An exclusive eval stage of the first seed
/// times each window alone (`timing.csv`, `prefill_time`). Kept without weights, as a results
/// folder is, the sweep refuses to evaluate them again until `--retrain` trains again the
/// cells the evaluations need, and those only, setting their earlier files aside. A run told to
/// stop starting cells at once runs none, and says how to go on.
#[test]
fn seeds_replicate_cells_and_plot_summarises_them() {
    let d = scratch("seeds");
    let src = d.join("corpus");
    std::fs::create_dir_all(&src).unwrap();
    let text = (0..60)
        .map(|i| format!("def f{i}(x):\n    return x * {i}\n"))
        .collect::<String>();
    std::fs::write(src.join("a.txt"), text).unwrap();
    let grid = d.join("grid.toml");
    std::fs::write(
        &grid,
        format!(
            "name = \"seeds\"\nseeds = 2\n[corpus]\ninput = [\"{src}\"]\nval_fraction = 0.2\n{base}\n\
             [[stage]]\nname = \"base\"\n\
             [[stage]]\nname = \"swa\"\ninit_from = \"base\"\nset = {{ \"attention.method\" = \"swa\" }}\n\
             axes = {{ \"attention.window\" = [4, 8] }}\n\
             [[stage]]\nname = \"timed\"\nkind = \"eval\"\nof = \"swa\"\nseeds = 1\nexclusive = true\n\
             set = {{ \"eval.timing\" = true }}\naxes = {{ \"eval.seq_len\" = [32, 64] }}\n",
            src = src.display(),
            base = tiny_base(&d.join("data"))
        ),
    )
    .unwrap();
    let out = d.join("sweep");
    // --stop-after 0 starts nothing and says how to go on; the same command then runs it all.
    let o = sweep(&grid, &out, &["--jobs", "2", "--stop-after", "0"]);
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains("0 cells done") && said.contains("run the same command again"),
        "{said}"
    );
    sweep(&grid, &out, &["--jobs", "2"]);
    cli("plot").flag("--sweep", &out).ok();
    let timing = log_rows(&out.join("timing.csv"));
    assert_eq!(timing.len(), 4, "one row per window and length: {timing:?}");
    assert!(out.join("figures/prefill_time.png").is_file());
    // Kept without weights: the timed cells cannot run again until --retrain.
    let seed_of = |dir: &Path| json(&dir.join("cell.json"))["config"]["train"]["seed"].as_u64();
    let first_seed = seed_of(&cell_dirs(&out, "base")[0]).min(seed_of(&cell_dirs(&out, "base")[1]));
    for stage in ["base", "swa"] {
        for c in cell_dirs(&out, stage) {
            let latest = std::fs::read_to_string(c.join("checkpoints/latest")).unwrap();
            std::fs::remove_file(
                c.join("checkpoints")
                    .join(latest.trim())
                    .join("model.safetensors"),
            )
            .unwrap();
        }
    }
    for c in cell_dirs(&out, "timed") {
        std::fs::remove_dir_all(c).unwrap();
    }
    let (gs, os) = (grid.to_str().unwrap(), out.to_str().unwrap());
    cli("sweep").flag("--grid", gs).flag("--out", os).fails();
    for c in cell_dirs(&out, "timed") {
        let error = status(&c)["error"].to_string();
        assert!(error.contains("--retrain"), "{error}");
    }
    // One timed cell by --cell: refused until the cells whose weights it needs are listed
    // too (its window and the base that window continued from), then run with that list,
    // which the refusal names.
    let cells = json(&out.join("cells.json"));
    let cells = cells.as_array().unwrap();
    let index_of = |dir: &Path| {
        let id = dir.file_name().unwrap().to_str().unwrap();
        cells.iter().find(|c| c["id"] == id).unwrap()["index"]
            .as_u64()
            .unwrap()
    };
    let timed = cell_dirs(&out, "timed")[0].clone();
    let one = index_of(&timed);
    let err = cli("sweep")
        .flag("--grid", gs)
        .flag("--out", os)
        .flag("--cell", one.to_string())
        .words("--retrain --retry-failed")
        .fails();
    let list = err.rsplit("--cell ").next().unwrap().trim().to_string();
    assert!(err.contains("list them too"), "{err}");
    assert_eq!(
        list.split(',').count(),
        3,
        "the timed cell, its window, the base: {err}"
    );
    assert!(list.split(',').any(|k| k == one.to_string()), "{err}");
    sweep(
        &grid,
        &out,
        &["--cell", &list, "--retrain", "--retry-failed"],
    );
    assert_eq!(status(&timed)["state"], "done");
    let err = cli("sweep")
        .flag("--grid", gs)
        .flag("--out", os)
        .words("--retrain --emit slurm")
        .fails();
    assert!(err.contains("--retrain") && err.contains("--emit"), "{err}");
    sweep(&grid, &out, &["--retrain", "--retry-failed"]);
    for c in cell_dirs(&out, "timed") {
        assert_eq!(status(&c)["state"], "done");
    }
    // The first seed's windows and the base they continue from trained again, the second
    // seed's not; what was there moved aside.
    for stage in ["base", "swa"] {
        for c in cell_dirs(&out, stage) {
            let again = c.join("before_retrain/train_log.csv").is_file();
            assert_eq!(again, seed_of(&c) == first_seed, "{}", c.display());
            assert_eq!(status(&c)["state"], "done");
        }
    }
    let summary = log_rows(&out.join("replicates.csv"));
    let loss: Vec<&Vec<String>> = summary
        .iter()
        .filter(|r| r[1] == "loss" && r[0] != "timed")
        .collect();
    assert_eq!(loss.len(), 3, "base and two windows: {summary:?}");
    for r in &loss {
        assert_eq!(r[4], "2", "{r:?}");
        let (low, mean, high): (f64, f64, f64) = (
            r[7].parse().unwrap(),
            r[5].parse().unwrap(),
            r[8].parse().unwrap(),
        );
        assert!(low <= mean && mean <= high, "{r:?}");
    }
    let diffs = log_rows(&out.join("replicate_differences.csv"));
    // The raw verdict and Holm's over the table's tests.
    assert!(diffs.iter().any(|r| r[0] == "swa"
        && r[1] == "loss"
        && ["within noise", "differs"].contains(&r[8].as_str())
        && ["within noise", "differs"].contains(&r[10].as_str())));
    // A results folder keeps the tables and cells.json, not the cells: `plot` there rebuilds
    // the replicate tables from tidy.csv, the same as from the cells.
    let kept = d.join("kept");
    std::fs::create_dir_all(&kept).unwrap();
    for f in ["cells.json", "tidy.csv"] {
        std::fs::copy(out.join(f), kept.join(f)).unwrap();
    }
    let o = cli("plot").flag("--sweep", &kept).ok();
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(said.contains("rebuilt from tidy.csv"), "{said}");
    assert_eq!(log_rows(&kept.join("replicates.csv")), summary);
    assert_eq!(log_rows(&kept.join("replicate_differences.csv")), diffs);
}

/// A grid's [probes] mixes probe documents into its [corpus]: the corpus is prepared at
/// probes.mix_with, the mixed data set at base.data.dir, and the base trains on it; without
/// mix_with the grid is refused before anything is written.
#[test]
fn grid_mixes_probes_into_its_corpus() {
    let d = scratch("grid_probes");
    let src = d.join("text");
    std::fs::create_dir_all(&src).unwrap();
    let doc = "the quick brown fox jumps over the lazy dog. ".repeat(400);
    std::fs::write(src.join("a.txt"), &doc).unwrap();
    let (corpus, data) = (d.join("corpus"), d.join("data"));
    let grid = |mix_with: &str| {
        format!(
            r#"
name = "probes"
[corpus]
input = ["{src}"]
val_fraction = 0.2
[probes]
{mix_with}
probe_fraction = 0.5
train_docs = 40
val_docs = 8
lengths = [120]
{base}
[[stage]]
name = "base"
set = {{ "attention.method" = "full" }}
"#,
            src = src.display(),
            base = tiny_base(&data)
        )
    };
    let g = d.join("grid.toml");
    std::fs::write(&g, grid("")).unwrap();
    let out = d.join("sweep");
    let (gs, os) = (g.to_str().unwrap(), out.to_str().unwrap());
    let err = cli("sweep")
        .flag("--grid", gs)
        .flag("--out", os)
        .words("--dry-run")
        .fails();
    assert!(err.contains("probes.mix_with"), "{err}");
    std::fs::write(&g, grid(&format!("mix_with = \"{}\"", data.display()))).unwrap();
    let err = cli("sweep")
        .flag("--grid", gs)
        .flag("--out", os)
        .words("--dry-run")
        .fails();
    assert!(err.contains("where the mixed data set goes"), "{err}");
    std::fs::write(&g, grid(&format!("mix_with = \"{}\"", corpus.display()))).unwrap();
    cli("sweep").flag("--grid", gs).flag("--out", os).ok();
    let text = json(&corpus.join("meta.json"));
    assert_eq!(text["corpus"]["files"], 1, "{text}");
    // 40 documents of 120 tokens at half the tokens: about 9,600, half of them probes.
    let mixed = json(&data.join("meta.json"));
    assert_eq!(mixed["probes"]["digits"], 7, "{mixed}");
    let m = mixed["train_tokens"].as_u64().unwrap();
    assert!((8_000..12_000).contains(&m), "{m} mixed train tokens");
    assert_eq!(status(&cell_dirs(&out, "base")[0])["state"], "done");
}

/// A grid over a pretrained model on a corpus held out per source: its train stage continues
/// from the pretrained weights (with the routers at their own rate), its eval stage without `of`
/// evaluates the pretrained model as the stage sets it, and every evaluation reports each
/// source's loss.
#[test]
fn a_grid_continues_and_evaluates_a_pretrained_model_per_source() {
    let d = scratch("pretrained_grid");
    let src = d.join("src");
    for (dir, word) in [
        ("code", "def f(x): return x\n"),
        ("prose", "the cat sat on the mat. "),
    ] {
        std::fs::create_dir_all(src.join(dir)).unwrap();
        std::fs::write(src.join(dir).join("a.txt"), word.repeat(120)).unwrap();
    }
    let sources = d.join("sources.toml");
    std::fs::write(
        &sources,
        "root = \"src\"\n[[source]]\nname = \"code\"\ninput = [\"code\"]\n\
         [[source]]\nname = \"prose\"\ninput = [\"prose\"]\n",
    )
    .unwrap();
    let data = d.join("data");
    cli("data prepare")
        .flag("--sources", &sources)
        .words("--val-fraction 0.3")
        .flag("--out", &data)
        .ok();
    let data_set = format!("data.dir={}", data.display());
    train(&d, &data_set, "pre", &[]);
    let pre = d.join("pre");
    let grid = d.join("grid.toml");
    std::fs::write(
        &grid,
        format!(
            "name = \"pre\"\npretrained = \"{pre}\"\n{base}\n\
             [[stage]]\nname = \"aha\"\nset = {{ \"attention.method\" = \"aha\", \"train.router_lr_mult\" = 30.0 }}\n\
             [[stage]]\nname = \"zs\"\nkind = \"eval\"\nset = {{ \"attention.method\" = \"swa\", \"attention.window\" = 4 }}\n",
            pre = pre.display(),
            base = tiny_base(&data)
        ),
    )
    .unwrap();
    let out = d.join("sweep");
    sweep(&grid, &out, &["--drop-optimizer"]);
    let aha = &cell_dirs(&out, "aha")[0];
    // Recorded from the cell's directory: the tree can move, and no machine's path is kept.
    assert_eq!(
        std::fs::read_to_string(aha.join("init_from.txt")).unwrap(),
        "../../pre"
    );
    // --drop-optimizer: the finished cell keeps its weights, not its optimizer state, and a
    // resume says why it cannot go on.
    let ckpts: Vec<PathBuf> = std::fs::read_dir(aha.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert!(!ckpts.is_empty());
    for c in &ckpts {
        assert!(c.join("model.safetensors").is_file() && !c.join("optim.safetensors").exists());
    }
    let err = cli("train").flag("--out", &aha).words("--resume").fails();
    assert!(err.contains("holds no optimizer state"), "{err}");
    let zs = &cell_dirs(&out, "zs")[0];
    for cell in [aha, zs] {
        let report = json(&cell.join("eval/eval.json"));
        let by: Vec<&str> = report["report"]["by_source"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["source"].as_str().unwrap())
            .collect();
        assert_eq!(by, ["code", "prose"], "{}", cell.display());
        let csv = std::fs::read_to_string(cell.join("eval/eval.csv")).unwrap();
        assert!(csv.contains("loss_prose,"), "{csv}");
    }
    // The eval cell evaluated the pretrained weights through a window.
    let zs_cfg = json(&zs.join("eval/eval.json"));
    assert_eq!(zs_cfg["config"]["attention"]["method"], "swa");
    // The summary gives each source's loss a column.
    cli("plot").flag("--sweep", &out).ok();
    let summary = std::fs::read_to_string(out.join("summary.csv")).unwrap();
    let header = summary.lines().next().unwrap();
    assert!(header.contains("loss_code,loss_prose"), "{header}");
    // A grid's eval stage needs `of` unless the grid names a pretrained model.
    let bare = d.join("bare.toml");
    std::fs::write(
        &bare,
        format!(
            "name = \"bare\"\n{base}\n[[stage]]\nname = \"zs\"\nkind = \"eval\"\n",
            base = tiny_base(&data)
        ),
    )
    .unwrap();
    let err = cli("sweep")
        .flag("--grid", &bare)
        .flag("--out", &out)
        .words("--dry-run")
        .fails();
    assert!(err.contains("needs `of`"), "{err}");
}

/// `kernels build`: a compute capability out of range or beside `--cpu` is refused by name,
/// and a build whose compiler fails leaves nothing in the kernel cache.
#[test]
fn kernel_builds_refuse_bad_targets_and_leave_nothing_when_they_fail() {
    assert!(cli("kernels build --arch 5")
        .fails()
        .contains("5 is not in 70..=121"));
    assert!(cli("kernels build --arch 90 --cpu")
        .fails()
        .contains("cannot be used with"));
    let cache = scratch("failed-kernel-build");
    let o = bin()
        .args(["kernels", "build", "--cpu"])
        .env("ATTNSWEEP_KERNELS_DIR", &cache)
        .env("CXX", "false")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("compiling"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&cache)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "a failed build left {left:?}");
}
