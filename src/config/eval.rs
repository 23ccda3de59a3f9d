//! `[eval]`: what evaluation measures (loss, gates, probes, multiple choice, timing).

use super::check::check;
use crate::data::probes::{ProbeSpec, Task};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Sequences per forward pass (loss evaluation, probes and multiple-choice items).
    pub batch_size: usize,
    /// At most this many batches of the validation split (0: all of it).
    pub max_batches: usize,
    /// Length of the sequences the loss and gate statistics are measured on (0: data.seq_len).
    /// Longer than training measures how a model extends, and lets gaps between a head's
    /// full-attention calls run longer before the sequence end cuts them off.
    pub seq_len: usize,
    /// Long-context probes run after the loss evaluation, scored by greedy generation:
    /// RULER's (niah_single_1-3, niah_multikey_1-3, niah_multivalue, niah_multiquery, vt, cwe,
    /// fwe; scored with RULER's string_match_all, the effective length in `ruler.csv`) and this
    /// project's short probes (niah_single, niah_multikey, niah_multivalue_short, passkey, mqar,
    /// variable_tracking).
    pub tasks: Vec<String>,
    /// Prompt lengths of the probes in tokens (empty: data.seq_len).
    pub lengths: Vec<usize>,
    /// Depths of the relevant needle, 0 = start of the context, 1 = just before the question.
    pub depths: Vec<f64>,
    /// Probes per (task, length), prompt s at depths[s mod len(depths)] for the tasks with a
    /// needle depth (fewer prompts than depths leave the last depths without any). RULER
    /// scores 500 a task and length; 100 give a proportion near 0.5 an interval of +/-0.1.
    pub samples: usize,
    pub haystack: HaystackKind,
    /// Data set whose val split the text haystack is cut from (empty: data.dir).
    pub haystack_dir: PathBuf,
    /// Seed of the probes' prompts, mixed with `train.seed`: each replicate draws its own
    /// prompts, and settings at one seed share them (their scores compare paired).
    pub probe_seed: u64,
    /// Digits of magic numbers and pass keys. Unset: the value the data set's probe documents
    /// were written with (`data probes`), else 7.
    pub digits: Option<usize>,
    /// Needles of the multi-key and multi-value tasks; variables in a tracking chain. Unset:
    /// the data set's probe documents', else 4.
    pub needles: Option<usize>,
    /// Keys asked at once in MQAR. Unset: the data set's probe documents', else 4.
    pub queries: Option<usize>,
    /// The probes' gates: the model's own ("learned"), or an oracle's ("oracle") that opens
    /// every gate exactly at the needles and the question (and what is generated after
    /// them) and closes it elsewhere: the ceiling of what a router could make of the prompts.
    /// The loss evaluation keeps the model's own.
    pub gates: ProbeGates,
    /// Wrap RULER's prompts in the model's chat template (from the `tokenizer_config.json`
    /// beside the data set's tokenizer), as RULER does for chat models; the answer prefix
    /// follows the template's generation prompt.
    pub chat: bool,
    /// Multiple-choice task files: JSONL lines with context, choices and gold (the index of
    /// the right choice), in the lm-evaluation-harness shape.
    pub mc: Vec<PathBuf>,
    /// Longest multiple-choice input in tokens; longer contexts lose their start (0: data.seq_len).
    pub max_length: usize,
    /// Also measure what inference costs in time (`eval.json`'s `timing`): one batch's forward
    /// and the attention layers' share of it, and a prefill followed by greedy decoding over
    /// the key-value cache. Off by default: measured times differ from run to run, and
    /// everything else an evaluation writes does not.
    pub timing: bool,
}

/// Whose gates a routed model's probes run with (`eval.gates`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum ProbeGates {
    #[default]
    Learned,
    Oracle,
}

/// Where probe haystacks come from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HaystackKind {
    /// RULER's repeated noise sentences.
    Noise,
    /// Windows of a prepared corpus.
    Text,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            batch_size: 16,
            max_batches: 50,
            seq_len: 0,
            tasks: Vec::new(),
            lengths: Vec::new(),
            depths: vec![0.0, 0.25, 0.5, 0.75, 1.0],
            samples: 100,
            haystack: HaystackKind::Noise,
            gates: ProbeGates::Learned,
            haystack_dir: PathBuf::new(),
            probe_seed: ProbeSpec::default().seed,
            digits: None,
            needles: None,
            queries: None,
            mc: Vec::new(),
            max_length: 0,
            timing: false,
            chat: false,
        }
    }
}

impl EvalConfig {
    /// The probe settings, unset ones at their defaults.
    pub(crate) fn probe_spec(&self) -> ProbeSpec {
        let d = ProbeSpec::default();
        ProbeSpec {
            seed: self.probe_seed,
            digits: self.digits.unwrap_or(d.digits),
            needles: self.needles.unwrap_or(d.needles),
            queries: self.queries.unwrap_or(d.queries),
            chat: None,
        }
    }
}

impl EvalConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        let e = self;
        check("eval.batch_size", e.batch_size, 1, 1 << 20)?;
        for t in &e.tasks {
            Task::parse(t).context("eval.tasks")?;
        }
        for &l in &e.lengths {
            check("eval.lengths", l, 8, 1 << 24)?;
        }
        for &d in &e.depths {
            check("eval.depths", d, 0.0, 1.0)?;
        }
        if !e.tasks.is_empty() && e.depths.is_empty() {
            bail!("eval.depths is empty; probes need at least one depth");
        }
        check("eval.samples", e.samples, 1, 1 << 24)?;
        if e.seq_len != 0 {
            check("eval.seq_len", e.seq_len, 2, 1 << 22)?;
        }
        if e.max_length != 0 {
            // One context token and one continuation token at least.
            check("eval.max_length", e.max_length, 2, 1 << 24)?;
        }
        e.probe_spec().validate().context("eval")?;
        Ok(())
    }
}
