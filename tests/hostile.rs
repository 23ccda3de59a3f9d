//! The toolkit used as a hostile user would: inputs that were once accepted silently, allocations
//! nobody checked, and messages that named no file or fix. Each test is named after the problem
//! it holds fixed; the unit tests beside the code cover the rest (see the closing notes).

mod common;
use common::{bin, synth};

use std::path::{Path, PathBuf};
use std::process::Output;

fn scratch(name: &str) -> PathBuf {
    common::scratch("hostile", name)
}

/// A tiny model trained for `steps` on the CPU.
fn tiny(steps: usize) -> Vec<String> {
    [
        "model.hidden_size=16",
        "model.intermediate_size=32",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=2",
        "data.seq_len=32",
        "train.batch_size=2",
        "train.warmup_steps=1",
        "train.ckpt_every=2",
        "train.device=cpu",
        "eval.max_batches=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("train.steps={steps}")])
    .collect()
}

/// `attnsweep train --out out` with `--set` for each of `sets`, then `extra` flags.
fn train(out: &Path, sets: &[String], extra: &[&str]) -> Output {
    let mut c = bin();
    c.args(["train", "-q", "--out"]).arg(out);
    for s in sets {
        c.args(["--set", s]);
    }
    c.args(extra).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Item 15: `sweep --jobs 0` is refused before anything else; a killed writer's temporary
/// shard is removed by the next `data synth`; an `--init-from` that does not fit leaves nothing
/// that blocks a second try into the same `--out`.
#[test]
fn leftovers_and_zero_jobs_block_nothing() {
    let dir = scratch("leftovers");
    let grid = common::tiny_grid(&dir, "", "");
    let o = bin()
        .args(["sweep", "--dry-run", "--jobs", "0", "--grid"])
        .arg(&grid)
        .output()
        .unwrap();
    assert!(
        !o.status.success() && stderr(&o).contains("--jobs"),
        "{}",
        stderr(&o)
    );

    let data = dir.join("synth");
    std::fs::create_dir_all(&data).unwrap();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = data.join(format!(".tmp-{dead}-train_000.bin"));
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    let o = bin()
        .args([
            "data",
            "synth",
            "--train-tokens",
            "4000",
            "--val-tokens",
            "2000",
            "--out",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !stale.exists(),
        "the killed writer's temporary shard is still there"
    );

    let data_set = synth(&dir, 6000);
    let base = dir.join("base");
    let mut sets = tiny(2);
    sets.push(data_set.clone());
    assert!(train(&base, &sets, &[]).status.success());
    let run = dir.join("run");
    let mut wider = sets.clone();
    wider.push("model.hidden_size=32".into());
    let o = train(&run, &wider, &["--init-from", base.to_str().unwrap()]);
    assert!(
        !o.status.success() && stderr(&o).contains("shape"),
        "{}",
        stderr(&o)
    );
    let o = train(&run, &sets, &["--init-from", base.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// The final weights of a run and the file they are in.
/// A tiny run of 4 steps on a synthetic corpus in a scratch directory `name`, stopped after
/// step 2 with its checkpoint: (the directory, the run, its settings).
fn stopped_after_two_steps(name: &str) -> (PathBuf, PathBuf, Vec<String>) {
    let dir = scratch(name);
    let data = synth(&dir, 6000);
    let mut sets = tiny(4);
    sets.push(data);
    let run = dir.join("run");
    assert!(train(&run, &sets, &["--stop-at-step", "2"])
        .status
        .success());
    (dir, run, sets)
}

fn final_weights(run: &Path) -> (PathBuf, Vec<(String, tch::Tensor)>) {
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    let file = run
        .join("checkpoints")
        .join(latest.trim())
        .join("model.safetensors");
    let tensors = tch::Tensor::read_safetensors(&file).unwrap();
    (file, tensors)
}

/// `tensors` written to `file` with the one named `name` replaced by `edit` of it.
fn with_edited(
    tensors: &[(String, tch::Tensor)],
    name: &str,
    edit: impl Fn(&tch::Tensor) -> tch::Tensor,
    file: &Path,
) {
    let edited: Vec<(String, tch::Tensor)> = tensors
        .iter()
        .map(|(n, t)| match n == name {
            true => (n.clone(), edit(t)),
            false => (n.clone(), t.shallow_clone()),
        })
        .collect();
    tch::Tensor::write_safetensors(&edited, file).unwrap();
}

/// Items 2 and 10: a weight that is not floating point, of another precision in a run's own
/// checkpoint, or not finite is refused on load, by name, by `eval --ckpt`, `--resume` and
/// `--init-from`; a converted model's other float type is loaded (and said so).
#[test]
fn weights_of_another_type_or_not_finite_are_refused_by_name() {
    use tch::Kind;
    let (dir, run, sets) = stopped_after_two_steps("weights");
    let (ckpt, tensors) = final_weights(&run);
    let name = "model.norm.weight";
    let eval_with = |file: &Path| {
        bin()
            .args(["eval", "-q", "--run"])
            .arg(&run)
            .arg("--ckpt")
            .arg(file)
            .args(["--out"])
            .arg(dir.join("eval"))
            .output()
            .unwrap()
    };
    // Integers where a weight belongs, and NaN in one: refused, the tensor named.
    let ints = dir.join("ints.safetensors");
    with_edited(&tensors, name, |t| t.to_kind(Kind::Int64), &ints);
    let e = stderr(&eval_with(&ints));
    assert!(e.contains(name) && e.contains("not floating point"), "{e}");
    let nan = dir.join("nan.safetensors");
    with_edited(&tensors, name, |t| t.fill(f64::NAN), &nan);
    let e = stderr(&eval_with(&nan));
    assert!(e.contains(name) && e.contains("non-finite"), "{e}");
    let o = train(
        &dir.join("from-nan"),
        &sets,
        &["--init-from", nan.to_str().unwrap()],
    );
    assert!(
        !o.status.success() && stderr(&o).contains(name),
        "{}",
        stderr(&o)
    );
    // A model file of another float type loads, converted; a run's own checkpoint of
    // another precision does not.
    let half = dir.join("half.safetensors");
    with_edited(&tensors, name, |t| t.to_kind(Kind::Half), &half);
    assert!(eval_with(&half).status.success());
    // Said so without -q (Reliability III, item 16), as --init-from says it.
    let o = bin()
        .args(["eval", "--run"])
        .arg(&run)
        .arg("--ckpt")
        .arg(&half)
        .args(["--out"])
        .arg(dir.join("eval-said"))
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(
        o.status.success() && e.contains("1 tensor converted from fp16 to the parameters' fp32"),
        "{e}"
    );
    with_edited(&tensors, name, |t| t.to_kind(Kind::Half), &ckpt);
    let o = bin()
        .args(["train", "-q", "--resume", "--out"])
        .arg(&run)
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains(name) && e.contains("Half"),
        "{e}"
    );
}

/// Item 10: a run that diverges before its first checkpoint says that no checkpoint was kept,
/// not that "the last good" one was.
#[test]
fn a_diverged_run_says_which_checkpoint_it_keeps() {
    let dir = scratch("diverged");
    let data = synth(&dir, 6000);
    let mut sets = tiny(30);
    sets.extend(
        [
            "train.lr=9.9",
            "train.grad_clip=0",
            "train.beta2=0",
            "train.warmup_steps=0",
            "train.ckpt_every=1000",
            "model.hidden_size=64",
            "model.intermediate_size=128",
        ]
        .map(String::from),
    );
    sets.push(data);
    let o = train(&dir.join("run"), &sets, &[]);
    let e = stderr(&o);
    assert!(!o.status.success() && e.contains("non-finite"), "{e}");
    assert!(
        e.contains("no checkpoint was written") && !e.contains("last good"),
        "{e}"
    );
}

/// Item 1: a run resumed after its data set was replaced under the same directory (another
/// seed, another vocabulary) or its shards replaced under the same meta.json is refused,
/// naming the directory; with the data set it started on it resumes.
#[test]
fn resume_refuses_a_replaced_data_set() {
    let (dir, run, _) = stopped_after_two_steps("replaced");
    let resume = || {
        bin()
            .args(["train", "-q", "--resume", "--out"])
            .arg(&run)
            .output()
            .unwrap()
    };
    let data_dir = dir.join("data");
    let moved = dir.join("data-first");
    // Another data set in the first one's place, made with `flags`.
    let replace = |flags: &[&str]| {
        std::fs::rename(&data_dir, &moved).unwrap();
        let o = bin()
            .args([
                "data",
                "synth",
                "--train-tokens",
                "6000",
                "--val-tokens",
                "4096",
            ])
            .args(["--max-distance", "64"])
            .args(flags)
            .arg("--out")
            .arg(&data_dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    replace(&["--seed", "2"]);
    let o = resume();
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("not the one this run started on"),
        "{e}"
    );
    assert!(e.contains(&*data_dir.to_string_lossy()), "{e}");
    // The other data set's shards under the first one's meta.json (Reliability III, item 11).
    let other_shard = std::fs::read(data_dir.join("train_000.bin")).unwrap();
    std::fs::remove_dir_all(&data_dir).unwrap();
    std::fs::rename(&moved, &data_dir).unwrap();
    let first_shard = std::fs::read(data_dir.join("train_000.bin")).unwrap();
    std::fs::write(data_dir.join("train_000.bin"), &other_shard).unwrap();
    let o = resume();
    let e = stderr(&o);
    assert!(
        !o.status.success() && e.contains("are not those its meta.json records"),
        "{e}"
    );
    std::fs::write(data_dir.join("train_000.bin"), &first_shard).unwrap();
    // A data set of another vocabulary is named as a replaced data set, not as a vocabulary.
    replace(&["--vocab-size", "300"]);
    let e = stderr(&resume());
    assert!(e.contains("not the one this run started on"), "{e}");
    std::fs::remove_dir_all(&data_dir).unwrap();
    std::fs::rename(&moved, &data_dir).unwrap();
    let o = resume();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Item 11: a corpus whose records lack the text field, or whose files hold no record, says so
/// and names `--text-field`; null Parquet rows are counted among the skipped records (the unit
/// test `every_format_is_read_in_order_and_unreadable_files_are_skipped_with_a_reason`).
#[test]
fn a_corpus_without_its_text_field_says_which_flag_names_it() {
    let dir = scratch("text-field");
    let prepare = |input: &Path, out: &str| {
        bin()
            .args(["data", "prepare", "--input"])
            .arg(input)
            .arg("--out")
            .arg(dir.join(out))
            .output()
            .unwrap()
    };
    let body = dir.join("body.jsonl");
    std::fs::write(
        &body,
        "{\"body\": \"one\", \"id\": 1}\n{\"body\": \"two\", \"id\": 2}\n",
    )
    .unwrap();
    let o = prepare(&body, "a");
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains("2 records were skipped")
            && e.contains("--text-field")
            && e.contains("\"body\""),
        "{e}"
    );
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let e = stderr(&prepare(&empty, "b"));
    assert!(e.contains("hold no record"), "{e}");
}

/// Item 7: a synthetic corpus larger than a shard holds is refused at once, before a token is
/// generated (it was built in memory first and aborted the process), and one that fits streams
/// to disk.
#[test]
fn a_synthetic_corpus_too_large_is_refused_before_it_is_built() {
    let dir = scratch("huge-synth");
    let start = std::time::Instant::now();
    let o = bin()
        .args([
            "data",
            "synth",
            "--train-tokens",
            "1000000000000000",
            "--out",
        ])
        .arg(dir.join("huge"))
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("--train-tokens") && !e.contains("backtrace"),
        "{e}"
    );
    assert!(start.elapsed().as_secs() < 10);
    assert!(!dir.join("huge").join("meta.json").exists());
}

/// Item 14: `sweep --dry-run` refuses cells that would fail at once: no data set and none made
/// by the grid, a vocabulary smaller than the data's, a sequence longer than any shard, and a
/// continuation from a model of another shape.
#[test]
fn a_dry_run_finds_cells_that_cannot_start() {
    let dir = scratch("dry-run");
    let data = synth(&dir, 6000);
    let data_dir = data.trim_start_matches("data.dir=").to_string();
    let dry = |name: &str, data: &str, model: &str, extra: &str| {
        let g = dir.join(format!("{name}.toml"));
        std::fs::write(
            &g,
            format!(
                "name = \"{name}\"\n[base.data]\n{data}\n[base.model]\nhidden_size = 16\n\
                 intermediate_size = 32\nnum_hidden_layers = 1\n{model}\n[base.train]\nsteps = 2\n\
                 warmup_steps = 1\n[[stage]]\nname = \"base\"\n\
                 set = {{ \"attention.method\" = \"full\" }}\n{extra}"
            ),
        )
        .unwrap();
        bin()
            .args(["sweep", "--dry-run", "--grid"])
            .arg(&g)
            .arg("--out")
            .arg(dir.join(name))
            .output()
            .unwrap()
    };
    let fine = format!("dir = \"{data_dir}\"\nseq_len = 32");
    let o = dry("fine", &fine, "", "");
    assert!(o.status.success(), "{}", stderr(&o));
    let wide = "[[stage]]\nname = \"wide\"\ninit_from = \"base\"\n\
                set = { \"model.hidden_size\" = 32 }\n";
    for (name, data, model, extra, says) in [
        (
            "nodata",
            "dir = \"/nonexistent/data\"".to_string(),
            "",
            "",
            "holds no data set",
        ),
        (
            "vocab",
            fine.clone(),
            "vocab_size = 10",
            "",
            "smaller than the data set's vocabulary",
        ),
        (
            "long",
            format!("dir = \"{data_dir}\"\nseq_len = 100000"),
            "",
            "",
            "longer than any train shard",
        ),
        ("shape", fine.clone(), "", wide, "another shape"),
    ] {
        let o = dry(name, &data, model, extra);
        let e = stderr(&o);
        assert!(!o.status.success() && e.contains(says), "{name}: {e}");
    }
}

/// Reliability III, items 12 and 13: `sweep --dry-run` checks what a cell will read beyond
/// its data: the grid's pretrained model (missing, a data set, a config without weights, or
/// of another shape than the cells'), and an eval cell's tasks (probes on the synthetic
/// corpus, a chat template on byte-level text, probes longer than the memory holds).
#[test]
fn a_dry_run_checks_the_pretrained_model_and_the_probes() {
    let dir = scratch("dry-run-reads");
    let synth_data = synth(&dir, 6000);
    let text_data = common::text_data(&dir);
    // A tiny model of the grids' shape, trained for two steps: the pretrained model.
    let model = [
        "model.hidden_size=16",
        "model.intermediate_size=32",
        "model.num_hidden_layers=1",
    ];
    let sets: Vec<String> = model
        .iter()
        .map(|s| s.to_string())
        .chain([
            format!("data.dir={}", text_data.display()),
            "data.seq_len=32".into(),
            "train.steps=2".into(),
            "train.warmup_steps=1".into(),
            "train.device=cpu".into(),
            "eval.max_batches=1".into(),
        ])
        .collect();
    let run = dir.join("pretrained");
    let o = train(&run, &sets, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let config_only = dir.join("config-only");
    std::fs::create_dir_all(&config_only).unwrap();
    std::fs::copy(run.join("config.toml"), config_only.join("config.toml")).unwrap();

    let dry = |name: &str, pretrained: &Path, data: &str, hidden: usize, eval: &str| {
        let g = dir.join(format!("{name}.toml"));
        std::fs::write(
            &g,
            format!(
                "name = \"{name}\"\npretrained = \"{}\"\n[base.data]\n{data}\nseq_len = 32\n\
                 [base.model]\nhidden_size = {hidden}\nintermediate_size = 32\nnum_hidden_layers = 1\n\
                 [base.train]\nsteps = 2\nwarmup_steps = 1\ndevice = \"cpu\"\n\
                 [[stage]]\nname = \"cpt\"\nset = {{ \"attention.method\" = \"full\" }}\n\
                 [[stage]]\nname = \"ev\"\nkind = \"eval\"\nof = \"cpt\"\nset = {{ {eval} }}\n",
                pretrained.display()
            ),
        )
        .unwrap();
        let o = bin()
            .args(["sweep", "--dry-run", "--grid"])
            .arg(&g)
            .arg("--out")
            .arg(dir.join(name))
            .output()
            .unwrap();
        (o.status.success(), stderr(&o))
    };
    let synth_dir = format!("dir = \"{}\"", synth_data.trim_start_matches("data.dir="));
    let text_dir = format!("dir = \"{}\"", text_data.display());
    let probes = r#""eval.tasks" = ["passkey"], "eval.lengths" = [64], "eval.samples" = 2"#;
    let (ok, e) = dry("fine", &run, &text_dir, 16, probes);
    assert!(ok, "{e}");
    let data_dir = text_data.clone();
    for (name, pretrained, data, hidden, eval, says) in [
        (
            "missing",
            dir.join("nowhere"),
            &text_dir,
            16,
            probes,
            "does not exist",
        ),
        (
            "data-set",
            data_dir,
            &text_dir,
            16,
            probes,
            "holds a data set (meta.json)",
        ),
        (
            "no-weights",
            config_only.clone(),
            &text_dir,
            16,
            probes,
            "but no weights",
        ),
        (
            "shape",
            run.clone(),
            &text_dir,
            32,
            probes,
            "is not of the cells' shape",
        ),
        (
            "synthetic",
            run.clone(),
            &synth_dir,
            16,
            probes,
            "was not prepared from text",
        ),
        (
            "chat",
            run.clone(),
            &text_dir,
            16,
            r#""eval.tasks" = ["passkey"], "eval.chat" = true"#,
            "has no chat template",
        ),
        (
            "long",
            run.clone(),
            &text_dir,
            16,
            r#""eval.tasks" = ["passkey"], "eval.lengths" = [16000000]"#,
            "the probes needs at least",
        ),
    ] {
        let (ok, e) = dry(name, &pretrained, data, hidden, eval);
        assert!(!ok && e.contains(says), "{name}: {e}");
    }
}

/// The demo writes where git does not look: a second `make demo` (or a first) leaves a clone's
/// tracked files as they were, though its tables hold measured rates.
#[test]
fn the_demo_writes_nothing_git_tracks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let makefile = std::fs::read_to_string(root.join("Makefile")).unwrap();
    let out = makefile
        .lines()
        .find_map(|l| l.strip_prefix("DEMO_OUT := "))
        .expect("the Makefile names the demo's output (DEMO_OUT)")
        .trim();
    assert!(
        makefile.contains("--grid sweeps/demo.toml --out $(DEMO_OUT)")
            && makefile.contains("plot --sweep $(DEMO_OUT)"),
        "the demo's sweep and plot write DEMO_OUT"
    );
    let ignore = std::fs::read_to_string(root.join(".gitignore")).unwrap();
    let top = out.split('/').next().unwrap();
    assert!(
        ignore.lines().any(|l| l.trim() == format!("/{top}")),
        "{out} is not ignored by .gitignore"
    );
}

/// A results folder keeps each cell's record and none of its weights: git sees a cell's status,
/// config, logs and evaluation (what `plot` reads), and ignores its checkpoints, weights and
/// locks, so a clone draws the tables again and adds cells beside them.
#[test]
fn a_results_folder_commits_each_cells_record_and_no_weights() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !root.join(".git").exists() {
        eprintln!("skipped: not a git checkout");
        return;
    }
    let cell = "results/some_grid/aha-0123abcd";
    let ignored = |p: &str| {
        std::process::Command::new("git")
            .args(["check-ignore", "-q", "--no-index", p])
            .current_dir(root)
            .status()
            .expect("git runs")
            .success()
    };
    for kept in [
        "status.json",
        "cell.json",
        "config.toml",
        "train_log.csv",
        "val_log.csv",
        "log.txt",
        "prune.json",
        "eval/eval.json",
        "eval/probe_samples.jsonl.gz",
    ] {
        assert!(!ignored(&format!("{cell}/{kept}")), "{kept} is ignored");
    }
    for dropped in [
        "checkpoints/step_00000016/model.safetensors",
        "checkpoints/latest",
        "model.safetensors",
        "lock",
        "train.lock",
        "before_retrain/train_log.csv",
        "eval/probe_journal.jsonl",
    ] {
        assert!(
            ignored(&format!("{cell}/{dropped}")),
            "{dropped} is not ignored"
        );
    }
    // A folder that is not a cell's stays out, as before.
    assert!(ignored("results/some_grid/scratch/x.csv"));
    assert!(!ignored("results/some_grid/figures/x.png"));
}

/// Reliability III, item 15: on the CPU the memory check's estimate grows with the batch as
/// the process's peak resident memory does, from below and within a third of it (it grew
/// at about half the rate, and let runs through that the kernel then killed). Two one-step
/// runs of 64 and 128 sequences of 1,024 tokens; `train_log.csv` holds both figures.
#[test]
fn the_cpu_memory_estimate_follows_what_training_holds() {
    let dir = scratch("memory-estimate");
    std::fs::create_dir_all(&dir).unwrap();
    let data = synth(&dir, 20_000);
    let figures = |batch: usize| -> (f64, f64) {
        let out = dir.join(format!("b{batch}"));
        let sets: Vec<String> = [
            "model.hidden_size=64",
            "model.intermediate_size=256",
            "model.num_hidden_layers=2",
            "model.num_attention_heads=4",
            "model.num_key_value_heads=2",
            "data.seq_len=1024",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.device=cpu",
            "train.loss_chunk_tokens=4096",
            "eval.max_batches=1",
            "eval.batch_size=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([data.clone(), format!("train.batch_size={batch}")])
        .collect();
        let o = train(&out, &sets, &[]);
        assert!(o.status.success(), "{}", stderr(&o));
        let log = std::fs::read_to_string(out.join("train_log.csv")).unwrap();
        let header: Vec<&str> = log.lines().next().unwrap().split(',').collect();
        let row: Vec<&str> = log.lines().nth(1).unwrap().split(',').collect();
        let col = |name: &str| -> f64 {
            let i = header.iter().position(|h| *h == name).unwrap();
            row[i]
                .parse()
                .unwrap_or_else(|_| panic!("{name} = {:?}", row[i]))
        };
        (col("peak_gib"), col("planned_gib"))
    };
    let (small, large) = (figures(64), figures(128));
    let (measured, planned) = (large.0 - small.0, large.1 - small.1);
    let ratio = measured / planned;
    assert!(
        (1.0..1.35).contains(&ratio),
        "65,536 more tokens took {measured:.3} GiB more at the peak, the estimate {planned:.3} GiB more (ratio {ratio:.2})"
    );
}
