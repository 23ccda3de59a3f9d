//! The experiment file: one TOML document with `[model]`, `[attention]`, `[data]`, `[train]`
//! and `[eval]` sections, one file each. Every field has a default, unknown keys are errors,
//! and every value is range-checked with a message naming its key. `--set section.key=value`
//! overrides (`overrides.rs`) are applied to the TOML tree before it is parsed, so they obey
//! exactly the same rules.

mod attention;
mod check;
mod eval;
mod model;
mod overrides;
mod train;

pub use attention::{AttentionConfig, AttnImpl, L2aStart, Method, Reduction, Router};
pub use eval::{EvalConfig, HaystackKind, ProbeGates};
pub use model::ModelConfig;
pub use model::{NormPlacement, QkNorm, RopeScaling};
pub(crate) use overrides::{apply_override, reject_non_finite};
pub(crate) use train::{parse_device, DeviceSpec};
pub use train::{Checkpointing, DataConfig, Dtype, TrainConfig};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A name as the config writes it (`"aha"`, `"train"`, `"mean"`).
pub(crate) fn name_of<T: Serialize>(v: T) -> String {
    toml::Value::try_from(v)
        .ok()
        .and_then(|v| v.as_str().map(String::from))
        .unwrap_or_default()
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub model: ModelConfig,
    pub attention: AttentionConfig,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub eval: EvalConfig,
}

impl Config {
    pub(crate) fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.attention.validate(&self.model, &self.train)?;
        self.data.validate()?;
        self.train.validate()?;
        if let Some(why) = self.graph_refusal().filter(|_| self.train.cuda_graph) {
            anyhow::bail!("{why}: leave train.cuda_graph off");
        }
        self.eval.validate()
    }

    /// Why `train.cuda_graph` could not replay this config's step, where it could not: a model
    /// off the kernel library (which the capture runs on), gates drawn afresh each step, which
    /// a replay would repeat, or a forward changed every step, which no capture would outlive.
    /// What the run's place decides (a GPU, one process, one pass a step) is the trainer's.
    pub(crate) fn graph_refusal(&self) -> Option<&'static str> {
        let head_dim = self.model.head_dim();
        if self.attention.attn_impl == AttnImpl::Reference
            || self.train.dtype != Dtype::Bf16
            || !(head_dim == 64 || head_dim == 128)
        {
            return Some(
                "train.cuda_graph captures the step the kernel library runs, which takes \
                 train.dtype = \"bf16\", head_dim 64 or 128 and attention.attn_impl other than \
                 \"reference\"",
            );
        }
        if self.attention.draws_gates() {
            return Some(
                "train.cuda_graph replays one captured step, but this model's gates are drawn \
                 afresh each step (attention.router = \"bernoulli\" or attention.ste_sample < 1), \
                 which a replay would repeat",
            );
        }
        let ramp = !self.attention.canonical().top_k_ramp.as_os_str().is_empty();
        (self.train.lambda_ramp || ramp).then_some(
            "train.cuda_graph replays one captured step, but train.lambda_ramp and \
             attention.top_k_ramp change the step's forward every step, so no capture would be \
             replayed",
        )
    }

    /// The length of the sequences evaluation measures: `eval.seq_len`, or `data.seq_len`
    /// when that is unset.
    pub(crate) fn eval_seq_len(&self) -> usize {
        match self.eval.seq_len {
            0 => self.data.seq_len,
            n => n,
        }
    }

    /// The setting `eval_seq_len` comes from, for messages.
    pub(crate) fn eval_seq_len_key(&self) -> &'static str {
        match self.eval.seq_len {
            0 => "data.seq_len",
            _ => "eval.seq_len",
        }
    }

    /// Reads an experiment file as a TOML tree (the defaults' empty tree when `path` is None).
    pub(crate) fn read_tree(path: Option<&Path>) -> Result<toml::Table> {
        let Some(p) = path else {
            return Ok(toml::Table::new());
        };
        let text = std::fs::read_to_string(p)
            .with_context(|| format!("cannot read config {}", p.display()))?;
        text.parse::<toml::Table>()
            .with_context(|| format!("{} is not valid TOML", p.display()))
    }

    /// A config from its TOML tree: every number finite, every key known, every value in range.
    /// A warm-up left at its default but longer than the run is cut to a tenth of the run,
    /// with a note; one set explicitly stays as set (and is refused if longer than the run).
    pub(crate) fn from_tree(tree: toml::Table) -> Result<Config> {
        reject_non_finite(&tree, "")?;
        check_names(&tree)?;
        let warmup_set = tree
            .get("train")
            .and_then(|t| t.get("warmup_steps"))
            .is_some();
        let mut cfg: Config = toml::Value::Table(tree).try_into()?;
        let t = &mut cfg.train;
        if !warmup_set && t.warmup_steps > t.steps {
            let warmup = t.steps / 10;
            eprintln!(
                "note: train.warmup_steps defaults to {} steps, longer than train.steps = {}: \
                 warming up over {warmup} (a tenth of the run); set train.warmup_steps to choose",
                t.warmup_steps, t.steps
            );
            t.warmup_steps = warmup;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads an experiment file (or the built-in defaults when `path` is None), applies
    /// `--set` overrides, and validates the result. An error names the file, or the override
    /// when the file alone is valid.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Config> {
        let base = Config::read_tree(path)?;
        let what = path
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "the defaults".into());
        let mut tree = base.clone();
        for o in overrides {
            apply_override(&mut tree, o)?;
        }
        match Config::from_tree(tree) {
            Ok(cfg) => Ok(cfg),
            Err(e) if overrides.is_empty() || Config::from_tree(base).is_err() => {
                Err(e.context(format!("invalid config ({what})")))
            }
            Err(e) => {
                // The file alone is valid: the override that breaks it is named, the first
                // one the error's key belongs to when it names one.
                let text = format!("{e:#}");
                let culprit = overrides
                    .iter()
                    .find(|o| {
                        o.split_once('=')
                            .is_some_and(|(k, _)| text.contains(k.trim()))
                    })
                    .map_or_else(|| overrides.join(" --set "), |o| o.clone());
                Err(e.context(format!("--set {culprit} makes {what} invalid")))
            }
        }
    }

    /// The config with every path in a form text can hold: a path that is not UTF-8 (an
    /// `eval --mc` file, say) is recorded as its lossy rendering. For reports only; the run
    /// itself opens the path as given.
    pub(crate) fn recordable(&self) -> Config {
        let mut c = self.clone();
        let lossy = |p: &mut PathBuf| {
            if p.to_str().is_none() {
                *p = PathBuf::from(p.to_string_lossy().into_owned());
            }
        };
        lossy(&mut c.data.dir);
        lossy(&mut c.attention.head_ranking);
        lossy(&mut c.eval.haystack_dir);
        c.eval.mc.iter_mut().for_each(lossy);
        c
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&self.recordable()).expect("config serialises")
    }

    /// The settings whose values differ between self and other, dotted (`train.lr`), with
    /// both values as TOML writes them.
    pub(crate) fn differences(&self, other: &Config) -> Vec<(String, String, String)> {
        fn walk(
            prefix: &str,
            a: &toml::Table,
            b: &toml::Table,
            out: &mut Vec<(String, String, String)>,
        ) {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let key = format!("{prefix}{k}");
                match (a.get(k), b.get(k)) {
                    (Some(toml::Value::Table(x)), Some(toml::Value::Table(y))) => {
                        walk(&format!("{key}."), x, y, out)
                    }
                    (x, y) if x != y => {
                        let show =
                            |v: Option<&toml::Value>| v.map_or("(unset)".into(), |v| v.to_string());
                        out.push((key, show(x), show(y)));
                    }
                    _ => {}
                }
            }
        }
        let table = |c: &Config| toml::Table::try_from(c).expect("config serialises");
        let mut out = Vec::new();
        walk("", &table(self), &table(other), &mut out);
        out
    }

    /// The same computation with every attention setting that its method ignores put back to
    /// its default (`AttentionConfig::canonical`): two configs that differ only there compute
    /// the same thing, so they identify the same sweep cell.
    pub(crate) fn canonical(&self) -> Config {
        let defaults = TrainConfig::default();
        Config {
            attention: self.attention.canonical(),
            // How many ranks share the global batch, and how many micro-batches a pass joins,
            // change where and how the work runs, not what it computes.
            train: TrainConfig {
                ranks: defaults.ranks,
                micro_batch: defaults.micro_batch,
                cuda_graph: defaults.cuda_graph,
                dist_timeout_s: defaults.dist_timeout_s,
                ..self.train.clone()
            },
            ..self.clone()
        }
    }

    /// The settings that differ from the defaults, as TOML: what identifies a computation,
    /// unchanged when a later version adds settings with defaults.
    pub(crate) fn non_default_toml(&self) -> String {
        fn strip(v: &mut toml::Table, d: &toml::Table) {
            v.retain(|k, x| match (x, d.get(k)) {
                (toml::Value::Table(t), Some(toml::Value::Table(dt))) => {
                    strip(t, dt);
                    !t.is_empty()
                }
                (x, Some(dx)) => x != dx,
                (_, None) => true,
            });
        }
        let table = |c: &Config| toml::Table::try_from(c).expect("config serialises");
        let mut t = table(self);
        strip(&mut t, &table(&Config::default()));
        toml::to_string_pretty(&t).expect("table serialises")
    }
}

/// Refuses a value that is not a string where a setting takes one (a name, a path), naming the
/// names it takes where it takes only some (`attention.method = 3`: one of full, swa, ...).
fn check_names(tree: &toml::Table) -> Result<()> {
    let defaults = toml::Table::try_from(Config::default()).expect("config serialises");
    for (section, given) in tree {
        let (Some(given), Some(toml::Value::Table(d))) = (given.as_table(), defaults.get(section))
        else {
            continue;
        };
        for (key, value) in given {
            if value.is_str() || !d.get(key).is_some_and(toml::Value::is_str) {
                continue;
            }
            let dotted = format!("{section}.{key}");
            bail!(match names_of(&dotted) {
                Some(names) => format!("{dotted} = {value} is not one of {}", names.join(", ")),
                None => format!("{dotted} = {value} must be a string"),
            });
        }
    }
    Ok(())
}

/// The names the setting `dotted` takes, read off the error a name it does not take gives;
/// None for a setting that takes any string.
fn names_of(dotted: &str) -> Option<Vec<String>> {
    let mut tree = toml::Table::new();
    apply_override(&mut tree, &format!("{dotted}=\"\u{1}\"")).ok()?;
    let e = toml::Value::Table(tree)
        .try_into::<Config>()
        .err()?
        .to_string();
    let expected = e.split_once("expected")?.1;
    let names: Vec<String> = expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    (!names.is_empty()).then_some(names)
}

/// The settings a resumed run may change (a dotted key, or a whole section): where and how often
/// it logs, checkpoints and evaluates, and which attention implementation computes the same
/// function. The others define the run: changed mid-run, its result would match neither
/// configuration, so `train --resume` refuses them.
pub(crate) const RESUME_MAY_CHANGE: &[&str] = &[
    "train.device",
    "train.ranks",
    "train.dist_timeout_s",
    "train.log_every",
    "train.ckpt_every",
    "train.keep_checkpoints",
    "train.eval_every",
    "train.activation_checkpointing",
    "train.loss_chunk_tokens",
    "train.micro_batch",
    "train.cuda_graph",
    "attention.attn_impl",
    "eval",
];

/// Whether `train --resume` may change the dotted setting `key`.
pub(crate) fn resume_may_change(key: &str) -> bool {
    RESUME_MAY_CHANGE.iter().any(|k| {
        key == *k
            || key
                .strip_prefix(k)
                .is_some_and(|rest| rest.starts_with('.'))
    })
}

#[cfg(test)]
mod tests {
    use super::overrides::parse_value;
    use super::*;

    fn err_of(toml_text: &str, sets: &[&str]) -> String {
        let dir = std::env::temp_dir().join(format!("attnsweep-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // One file per call: tests run in parallel threads.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let p = dir.join(format!("c{n}.toml"));
        std::fs::write(&p, toml_text).unwrap();
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        format!("{:#}", Config::load(Some(&p), &sets).unwrap_err())
    }

    /// Differences name every changed leaf setting with both values; resume may change the
    /// listed keys and every key of a listed section, nothing that merely shares a prefix.
    #[test]
    fn differences_and_what_resume_may_change() {
        let a = Config::default();
        let set = |s: &[&str]| {
            let sets: Vec<String> = s.iter().map(|x| x.to_string()).collect();
            Config::load(None, &sets).unwrap()
        };
        assert!(a.differences(&a).is_empty());
        let b = set(&["train.lr=0.5", "attention.method=swa", "eval.batch_size=3"]);
        let keys: Vec<String> = a.differences(&b).into_iter().map(|d| d.0).collect();
        assert_eq!(keys, ["attention.method", "eval.batch_size", "train.lr"]);
        let (_, was, now) = &a.differences(&b)[2];
        assert_eq!(
            (was.as_str(), now.as_str()),
            (&*a.train.lr.to_string(), "0.5")
        );
        for key in [
            "train.device",
            "eval.batch_size",
            "eval",
            "attention.attn_impl",
        ] {
            assert!(resume_may_change(key), "{key}");
        }
        for key in [
            "train.lr",
            "train.steps",
            "evaluation.x",
            "train.device_x",
            "attention",
        ] {
            assert!(!resume_may_change(key), "{key}");
        }
    }

    /// NaN passes any `lo <= v <= hi` written as `v < lo || v > hi`; TOML allows nan and inf.
    /// Every non-finite number is refused, from a file or an override, naming the key.
    #[test]
    fn non_finite_numbers_are_refused_everywhere() {
        for set in [
            "attention.ppa_power=nan",
            "attention.tau=nan",
            "attention.bernoulli_p=nan",
            "attention.p_force=nan",
            "train.weight_decay=nan",
            "train.grad_clip=inf",
            "eval.depths=[0.5, nan]",
            "attention.swiattn_alpha=-inf",
        ] {
            let key = set.split('=').next().unwrap();
            let e = err_of("", &[set]);
            assert!(
                e.contains(key) && e.contains("not a finite number"),
                "{set}: {e}"
            );
        }
        // A finite base too small for the rotary frequencies to stay finite.
        let e = err_of("", &["model.rope_theta=1e-300"]);
        assert!(
            e.contains("model.rope_theta") && e.contains("out of range"),
            "{e}"
        );
        let e = err_of("[train]\ngrad_clip = nan\n", &[]);
        assert!(e.contains("train.grad_clip") && e.contains("finite"), "{e}");
        let e = err_of(
            "[model.rope_scaling]\nrope_type = \"linear\"\nfactor = inf\n",
            &[],
        );
        assert!(e.contains("model.rope_scaling.factor"), "{e}");
    }

    /// An error caused by an override names the override, not the file it was applied to.
    #[test]
    fn errors_blame_the_override_that_caused_them() {
        let e = err_of("[train]\nlr = 0.01\n", &["data.seq_len=1"]);
        assert!(
            e.contains("--set data.seq_len=1") && e.contains("data.seq_len = 1"),
            "{e}"
        );
        let e = err_of("[train]\nsteps = 0\n", &["data.seq_len=64"]);
        assert!(e.contains("invalid config") && !e.contains("--set"), "{e}");
        let e = err_of("", &["eval.max_length=1"]);
        assert!(e.contains("eval.max_length = 1"), "{e}");
        // AHA's start assignment and static heads' ramp on another method would be unread.
        let e = err_of("", &["attention.router_init_heads=\"r.csv\""]);
        assert!(e.contains("attention.router_init_heads"), "{e}");
        let e = err_of("", &["attention.top_k_ramp=\"log.csv\""]);
        assert!(
            e.contains("attention.top_k_ramp") && e.contains("\"full\""),
            "{e}"
        );
        let e = err_of("", &["eval.seq_len=1"]);
        assert!(e.contains("eval.seq_len = 1"), "{e}");
        let e = err_of("", &["train.router_hold_steps=5"]);
        assert!(
            e.contains("train.router_hold_steps = 5") && e.contains("\"l2a\""),
            "{e}"
        );
        let e = err_of(
            "[attention]\nmethod = \"l2a\"\nrouter = \"bernoulli\"\n",
            &["train.router_hold_steps=5"],
        );
        assert!(e.contains("learned router only"), "{e}");
        let e = err_of("", &["train.lambda_ramp=true"]);
        assert!(
            e.contains("train.lambda_ramp") && e.contains("set it to false"),
            "{e}"
        );
    }

    /// A number too large for any setting is out of range, not "a string"; a setting that
    /// takes one of some names, given something else, lists them.
    #[test]
    fn wrong_values_are_named_as_such() {
        let e = err_of("", &["attention.window=99999999999999999999"]);
        assert!(
            e.contains("attention.window") && e.contains("out of range") && !e.contains("string"),
            "{e}"
        );
        for (set, names) in [
            ("attention.method=3", "full, swa, ppa"),
            ("attention.router=[1]", "learned, bernoulli"),
            ("train.dtype=true", "fp32, bf16"),
        ] {
            let e = err_of("", &[set]);
            let key = set.split('=').next().unwrap();
            assert!(
                e.contains(key) && e.contains(&format!("one of {names}")),
                "{set}: {e}"
            );
        }
        let e = err_of("[attention]\nmethod = 3\n", &[]);
        assert!(
            e.contains("attention.method") && e.contains("one of full"),
            "{e}"
        );
        let e = err_of("", &["train.device=3"]);
        assert!(e.contains("train.device") && e.contains("string"), "{e}");
    }

    /// Bernoulli rates a layer: one for the layer, or one a gate (AHA: a head; L2A: the
    /// layer's one gate); any other count is refused, naming the layer, rather than read as
    /// one global rate.
    #[test]
    fn bernoulli_rates_hold_one_rate_a_layer_or_one_a_gate() {
        let m = Config::default().model;
        let rates = |n: usize| {
            let layer = format!("[{}]", vec!["0.1"; n].join(", "));
            format!("[{}]", vec![layer; m.num_hidden_layers].join(", "))
        };
        let load = |method: &str, n: usize| {
            let sets = [
                format!("attention.method={method}"),
                "attention.router=bernoulli".to_string(),
                format!("attention.bernoulli_rates={}", rates(n)),
            ];
            Config::load(None, &sets)
        };
        let heads = m.num_attention_heads;
        assert!(load("aha", 1).is_ok() && load("aha", heads).is_ok());
        assert!(load("l2a", 1).is_ok() && load("swiattn", 1).is_ok());
        let e = format!("{:#}", load("l2a", heads).unwrap_err());
        assert!(
            e.contains("layer 0 holds") && e.contains("one rate a layer or one a gate"),
            "{e}"
        );
        assert!(load("aha", heads + 1).is_err());
    }

    /// Lists of bare words need no quotes, as single bare words need none.
    #[test]
    fn bare_words_in_lists_are_strings() {
        let c = Config::load(None, &["eval.tasks=[passkey, mqar]".into()]).unwrap();
        assert_eq!(c.eval.tasks, ["passkey", "mqar"]);
        let c = Config::load(None, &["eval.lengths=[64,128]".into()]).unwrap();
        assert_eq!(c.eval.lengths, [64, 128]);
        assert_eq!(parse_value("[a, 2, true]").as_array().unwrap().len(), 3);
        assert_eq!(
            parse_value("[\"a\", b]"),
            toml::Value::String("[\"a\", b]".into())
        );
    }

    /// Settings a method ignores do not make two configs different computations; settings
    /// it reads do.
    #[test]
    fn canonical_sets_aside_what_a_method_ignores() {
        let load = |sets: &[&str]| {
            let v: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::load(None, &v).unwrap().canonical()
        };
        assert_eq!(
            load(&[
                "attention.method=full",
                "attention.lambda=0.1",
                "attention.window=8"
            ]),
            load(&["attention.method=full"])
        );
        assert_eq!(
            load(&[
                "attention.method=swa",
                "attention.ppa_power=0.9",
                "attention.tau=0.2"
            ]),
            load(&["attention.method=swa"])
        );
        assert_eq!(
            load(&[
                "attention.method=aha",
                "attention.router=bernoulli",
                "attention.lambda=1"
            ]),
            load(&["attention.method=aha", "attention.router=bernoulli"])
        );
        assert_eq!(
            load(&[
                "attention.method=swiattn",
                "attention.swiattn_adaptive=false",
                "attention.swiattn_alpha=3"
            ]),
            load(&[
                "attention.method=swiattn",
                "attention.swiattn_adaptive=false"
            ])
        );
        assert_ne!(
            load(&["attention.method=aha", "attention.lambda=0.1"]),
            load(&["attention.method=aha"])
        );
        assert_ne!(
            load(&["attention.method=swa", "attention.window=8"]),
            load(&["attention.method=swa"])
        );
        assert_ne!(
            load(&[
                "attention.method=swiattn",
                "attention.swiattn_disagreement=sum"
            ]),
            load(&["attention.method=swiattn"])
        );
    }

    /// A run shorter than the default warm-up warms up over a tenth of itself; a warm-up set
    /// longer than the run is refused, naming both.
    #[test]
    fn a_default_warmup_fits_a_short_run() {
        let c = Config::load(None, &["train.steps=20".into()]).unwrap();
        assert_eq!(c.train.warmup_steps, 2);
        let c = Config::load(None, &["train.steps=500".into()]).unwrap();
        assert_eq!(c.train.warmup_steps, 100);
        let e = Config::load(
            None,
            &["train.steps=20".into(), "train.warmup_steps=50".into()],
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("train.warmup_steps"), "{e:#}");
    }

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = Config::default();
        c.validate().unwrap();
        let back: Config = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn overrides_parse_types_and_bare_strings() {
        let c = Config::load(
            None,
            &[
                "attention.method=swa".into(),
                "attention.window=16".into(),
                "train.lr=0.01".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.attention.method, Method::Swa);
        assert_eq!(c.attention.window, 16);
        assert_eq!(c.train.lr, 0.01);
    }

    #[test]
    fn errors_name_the_problem() {
        assert!(err_of("[model\nx=1", &[]).contains("not valid TOML"));
        assert!(err_of("[model]\nhiden_size = 3\n", &[]).contains("hiden_size"));
        assert!(err_of("[nosuch]\n", &[]).contains("nosuch"));
        let e = err_of("", &["attention.ppa_power=1.5"]);
        assert!(
            e.contains("attention.ppa_power") && e.contains("0 ..= 1"),
            "{e}"
        );
        let e = err_of(
            "[model]\nnum_attention_heads = 4\nnum_key_value_heads = 3\n",
            &[],
        );
        assert!(e.contains("num_key_value_heads"), "{e}");
        assert!(err_of("", &["attention.method=sparse"]).contains("sparse"));
        assert!(err_of("", &["train.device=tpu"]).contains("train.device"));
        assert!(err_of("", &["window=3"]).contains("section.key"));
        assert!(err_of("", &["train.steps=0"]).contains("train.steps"));
        for bad in ["0", "1.5", "-0.1"] {
            let e = err_of("", &[&format!("attention.ste_sample={bad}")]);
            assert!(
                e.contains("attention.ste_sample") && e.contains("(0, 1]"),
                "{e}"
            );
        }
    }
}
