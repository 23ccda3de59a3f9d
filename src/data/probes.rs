//! Long-context probes generated from a seed: RULER's task family under RULER's names
//! (`data::ruler`), and this project's short probes in RULER's style, small enough for a model
//! trained from scratch to learn their format: needle in a haystack (one needle, several keys,
//! several values for one key), passkey retrieval, multi-query associative recall (Zoology's
//! MQAR, written as text) and variable tracking.
//!
//! A probe is text pieces and answers; the evaluated model's tokenizer renders them, so any
//! tokenizer works and nothing is downloaded. The prompt is filled with haystack tokens up to
//! exactly the requested length: RULER's noise sentences, or a window of a prepared corpus.
//! The relevant needle starts at the requested depth (0 = the start of the context, 1 = just
//! before the question). The same generator writes training documents (prompt, answer, end
//! of document), so small models can learn the format.

use super::meta::{prepare_out_dir, read_meta, Meta, ProbeDocs};
pub(crate) use super::needles::Haystack;
use super::needles::{
    distinct, haystack_tokens, key, number, place, variable, Placement, NOISE, WORDS,
};
use super::ruler::{self, Ruler, RULER};
use super::shards::{ShardWriter, Split, Width, TOKENS_MAGIC};
use super::tokenizer::ChatWrap;
use super::tokenizer::{finish_text_dataset, tokenizer_of, TextTokenizer};
use crate::util::flags::finite_flag;
use crate::util::rng::Rng;
use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Task {
    NiahSingle,
    NiahMultikey,
    NiahMultivalue,
    Passkey,
    Mqar,
    VariableTracking,
    Ruler(Ruler),
}

/// The short probes (RULER's tasks are `ruler::RULER`).
pub(crate) const TASKS: [Task; 6] = [
    Task::NiahSingle,
    Task::NiahMultikey,
    Task::NiahMultivalue,
    Task::Passkey,
    Task::Mqar,
    Task::VariableTracking,
];

impl Task {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Task::NiahSingle => "niah_single",
            Task::NiahMultikey => "niah_multikey",
            Task::NiahMultivalue => "niah_multivalue_short",
            Task::Passkey => "passkey",
            Task::Mqar => "mqar",
            Task::VariableTracking => "variable_tracking",
            Task::Ruler(r) => r.name(),
        }
    }

    /// The task's part of a probe's seed: the short probes' as they always were (their
    /// order), RULER's after them.
    fn seed_key(self) -> u64 {
        match self {
            Task::NiahSingle => 0,
            Task::NiahMultikey => 1,
            Task::NiahMultivalue => 2,
            Task::Passkey => 3,
            Task::Mqar => 4,
            Task::VariableTracking => 5,
            Task::Ruler(r) => 100 + r as u64,
        }
    }

    pub(crate) fn parse(name: &str) -> Result<Task> {
        let all = TASKS.into_iter().chain(RULER.map(Task::Ruler));
        match all.clone().find(|t| t.name() == name) {
            Some(t) => Ok(t),
            None => bail!(
                "unknown probe task {name:?}; known: {}",
                all.map(|t| t.name()).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// Whether the task places its needle at a chosen depth (MQAR fills the whole context
    /// with pairs instead).
    pub(crate) fn has_depth(self) -> bool {
        match self {
            Task::Mqar => false,
            Task::Ruler(r) => r.has_depth(),
            _ => true,
        }
    }
}

/// Everything a probe's text depends on besides the task and its position in the grid.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ProbeSpec {
    pub(crate) seed: u64,
    /// Digits of every magic number and pass key (RULER uses 7).
    pub(crate) digits: usize,
    /// Needles (distractor keys or values) of the multi-needle tasks, and variables of the
    /// variable-tracking chain.
    pub(crate) needles: usize,
    /// Keys asked at once in MQAR.
    pub(crate) queries: usize,
    /// The chat template's turn around RULER's prompts (None: the bare prompt).
    pub(crate) chat: Option<ChatWrap>,
}

impl Default for ProbeSpec {
    fn default() -> Self {
        ProbeSpec {
            seed: 1234,
            digits: 7,
            needles: 4,
            queries: 4,
            chat: None,
        }
    }
}

impl ProbeSpec {
    pub(crate) fn validate(&self) -> Result<()> {
        ensure!(
            (1..=18).contains(&self.digits),
            "probe digits {} must be in 1 ..= 18",
            self.digits
        );
        ensure!(
            (2..=64).contains(&self.needles),
            "probe needles {} must be in 2 ..= 64",
            self.needles
        );
        ensure!(
            (1..=64).contains(&self.queries),
            "probe queries {} must be in 1 ..= 64",
            self.queries
        );
        Ok(())
    }
}

/// One rendered probe.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Probe {
    pub(crate) task: Task,
    /// Tokens of the prompt; exactly the requested length.
    pub(crate) prompt: Vec<u32>,
    /// What the model should generate after the prompt, e.g. " 4821937" or " 12, 57".
    pub(crate) target: String,
    /// The separate answers inside the target (one for single-answer tasks).
    pub(crate) answers: Vec<String>,
    /// Token index where the relevant needle starts.
    pub(crate) needle_at: usize,
    /// Haystack tokens before the relevant needle over all haystack tokens: the requested
    /// depth snapped to a sentence start.
    pub(crate) depth: f64,
    /// What the answer rests on, `[start, end)` token ranges of the prompt: every needle and
    /// the question (to the prompt's end). An oracle router opens exactly these (and what
    /// is generated after them).
    pub(crate) spans: Vec<(usize, usize)>,
}

/// Generation of the answer stops at any of these characters (or at the end of document).
pub(crate) const STOP: [char; 2] = ['.', '\n'];

/// The text a training document puts after the answer.
const END: &str = ".\n";

/// Text pieces of a probe before rendering.
struct Draft {
    /// `(text, placed)`: needles in the order they must appear; `placed` is the index of the
    /// one at the requested depth; the others go to random positions (after it for chains).
    needles: Vec<String>,
    placed: usize,
    /// Needles after `placed` keep their order and follow it (variable tracking).
    chain: bool,
    question: String,
    answers: Vec<String>,
    /// Answers joined as the target writes them.
    target: String,
}

fn magic(key: &str, value: &str) -> String {
    format!(" The magic number for {key} is {value}.")
}

fn draft(task: Task, spec: &ProbeSpec, rng: &mut Rng) -> Draft {
    let digits = |rng: &mut Rng| number(rng, spec.digits);
    let one = |needles: Vec<String>, placed: usize, question: String, answer: String| Draft {
        needles,
        placed,
        chain: false,
        question,
        target: format!(" {answer}"),
        answers: vec![answer],
    };
    match task {
        Task::NiahSingle => {
            let (k, v) = (key(rng), digits(rng));
            let q = format!("\nQuestion: the magic number for {k} is");
            one(vec![magic(&k, &v)], 0, q, v)
        }
        Task::NiahMultikey => {
            let keys = distinct(rng, spec.needles, key);
            let values = distinct(rng, spec.needles, digits);
            let asked = rng.below(spec.needles as u64) as usize;
            let needles = keys.iter().zip(&values).map(|(k, v)| magic(k, v)).collect();
            let q = format!("\nQuestion: the magic number for {} is", keys[asked]);
            one(needles, asked, q, values[asked].clone())
        }
        Task::NiahMultivalue => {
            let k = key(rng);
            let values = distinct(rng, spec.needles, digits);
            Draft {
                needles: values.iter().map(|v| magic(&k, v)).collect(),
                placed: 0,
                chain: true,
                question: format!("\nQuestion: the magic numbers for {k} are"),
                target: format!(" {}", values.join(", ")),
                answers: values,
            }
        }
        Task::Passkey => {
            let v = digits(rng);
            let needle = format!(" The pass key is {v}. Remember it. {v} is the pass key.");
            one(vec![needle], 0, "\nQuestion: the pass key is".into(), v)
        }
        Task::VariableTracking => {
            let names = distinct(rng, spec.needles, variable);
            let v = digits(rng);
            let mut needles = vec![format!(" VAR {} = {v}.", names[0])];
            needles.extend(
                names
                    .windows(2)
                    .map(|w| format!(" VAR {} = VAR {}.", w[1], w[0])),
            );
            Draft {
                needles,
                placed: 0,
                chain: true,
                question: format!("\nQuestion: the variables holding {v} are"),
                target: format!(" {}", names.join(", ")),
                answers: names,
            }
        }
        Task::Mqar | Task::Ruler(_) => unreachable!("MQAR and RULER's tasks are drafted apart"),
    }
}

/// Renders the probe of `task` at `length` tokens and `depth` (ignored by MQAR), the
/// `sample`-th of its grid cell. Deterministic in (spec, task, length, depth, sample).
pub(crate) fn generate(
    task: Task,
    spec: &ProbeSpec,
    haystack: &Haystack,
    tok: &TextTokenizer,
    length: usize,
    depth: f64,
    sample: u64,
) -> Result<Probe> {
    ensure!(
        (0.0..=1.0).contains(&depth),
        "needle depth {depth} must be in 0 ..= 1"
    );
    let mut rng = Rng::new(
        [task.seed_key(), length as u64, depth.to_bits(), sample]
            .iter()
            .fold(spec.seed, |acc, k| Rng::new(acc ^ k).next_u64()),
    );
    if let Task::Ruler(r) = task {
        let chat = spec.chat.as_ref();
        let p = ruler::generate(r, spec.digits, chat, haystack, tok, length, depth, &mut rng)?;
        return Ok(Probe {
            task,
            prompt: p.prompt,
            target: format!(" {}", p.answers.join(", ")),
            answers: p.answers,
            needle_at: p.needle_at,
            depth: p.depth,
            spans: p.spans,
        });
    }
    let enc = |s: &str| tok.encode(s);
    if task == Task::Mqar {
        return mqar(spec, &mut rng, tok, length);
    }
    let d = draft(task, spec, &mut rng);
    let needles: Vec<Vec<u32>> = d.needles.iter().map(|n| enc(n)).collect::<Result<_>>()?;
    let question = enc(&d.question)?;
    let fixed = needles.iter().map(Vec::len).sum::<usize>() + question.len();
    ensure!(
        fixed < length,
        "length {length} is too short for {}: its needles and question take {fixed} tokens",
        task.name()
    );
    let budget = length - fixed;
    let (hay, starts) = haystack_tokens(haystack, budget, tok, &mut rng)?;
    let Placement {
        tokens: mut prompt,
        needle_at,
        depth: achieved,
        order,
        mut spans,
    } = place(&hay, &starts, &needles, d.placed, d.chain, depth, &mut rng);
    spans.push((prompt.len(), length));
    prompt.extend(&question);
    debug_assert_eq!(prompt.len(), length);
    // Multi-value answers are asked in the order the values appear.
    let (target, answers) = if task == Task::NiahMultivalue {
        let vals: Vec<String> = order.iter().map(|&i| d.answers[i].clone()).collect();
        (format!(" {}", vals.join(", ")), vals)
    } else {
        (d.target, d.answers)
    };
    Ok(Probe {
        task,
        prompt,
        target,
        answers,
        needle_at,
        depth: achieved,
        spans,
    })
}

/// MQAR: the context is key-value pairs " {key}: {value}." up to the length, then a
/// question naming `queries` of the keys; the answer lists their values in that order.
fn mqar(spec: &ProbeSpec, rng: &mut Rng, tok: &TextTokenizer, length: usize) -> Result<Probe> {
    let enc = |s: &str| tok.encode(s);
    // Keys must be distinct; at most as many pairs as there are keys.
    let mut keys: Vec<String> = Vec::new();
    let mut pairs: Vec<(String, String, Vec<u32>)> = Vec::new();
    let mut used = 0usize;
    // The question's length depends on which keys are asked: reserve for the longest.
    let mut longest = 0;
    for w in WORDS {
        longest = longest.max(enc(&format!(" {w}-{w},"))?.len());
    }
    let reserve = enc("\nQuestion: ?")?.len() + spec.queries * longest;
    loop {
        let k = key(rng);
        if keys.contains(&k) {
            if keys.len() >= WORDS.len() * WORDS.len() / 2 {
                break;
            }
            continue;
        }
        let v = number(rng, spec.digits);
        let t = enc(&format!(" {k}: {v}."))?;
        if used + t.len() + reserve > length {
            break;
        }
        used += t.len();
        keys.push(k.clone());
        pairs.push((k, v, t));
    }
    ensure!(
        pairs.len() >= spec.queries,
        "length {length} is too short for mqar: {} pairs fit, {} are asked",
        pairs.len(),
        spec.queries
    );
    let mut asked: Vec<usize> = Vec::new();
    while asked.len() < spec.queries {
        let i = rng.below(pairs.len() as u64) as usize;
        if !asked.contains(&i) {
            asked.push(i);
        }
    }
    let names: Vec<&str> = asked.iter().map(|&i| pairs[i].0.as_str()).collect();
    let question = enc(&format!("\nQuestion: {}?", names.join(", ")))?;
    let mut prompt: Vec<u32> = pairs.iter().flat_map(|p| p.2.iter().copied()).collect();
    ensure!(
        prompt.len() + question.len() <= length,
        "length {length} is too short for mqar's pairs and question"
    );
    // Pad with the noise haystack's first sentence so the prompt has exactly `length` tokens.
    let pad = length - prompt.len() - question.len();
    let filler = enc(NOISE[0])?;
    let mut head: Vec<u32> = filler.iter().copied().cycle().take(pad).collect();
    let needle_at = head.len() + pairs[..asked[0]].iter().map(|p| p.2.len()).sum::<usize>();
    // The asked pairs and the question.
    let mut spans: Vec<(usize, usize)> = Vec::new();
    let mut at = head.len();
    for (i, p) in pairs.iter().enumerate() {
        if asked.contains(&i) {
            spans.push((at, at + p.2.len()));
        }
        at += p.2.len();
    }
    spans.sort_unstable();
    spans.push((at, length));
    head.append(&mut prompt);
    head.extend(&question);
    let answers: Vec<String> = asked.iter().map(|&i| pairs[i].1.clone()).collect();
    Ok(Probe {
        task: Task::Mqar,
        prompt: head,
        target: format!(" {}", answers.join(", ")),
        answers,
        needle_at,
        depth: needle_at as f64 / length as f64,
        spans,
    })
}

impl Probe {
    /// The probe as a training document: prompt, target, end of answer, end of document.
    pub(crate) fn document(&self, tok: &TextTokenizer) -> Result<Vec<u32>> {
        let mut doc = self.prompt.clone();
        doc.extend(tok.encode(&format!("{}{END}", self.target))?);
        doc.extend(tok.eot());
        Ok(doc)
    }

    /// Scores generated text: `(exact_match, recall)`. The prediction is the text before the
    /// first stop character; exact match compares it (trimmed) with the target, recall is
    /// the fraction of answers found in it (RULER's string match).
    /// RULER's tasks score the whole generation with RULER's `string_match_all` (the recall;
    /// exact match when every answer is found).
    pub(crate) fn score(&self, generated: &str) -> (f64, f64) {
        if let Task::Ruler(_) = self.task {
            let s = ruler::string_match_all(&self.answers, generated);
            return ((s == 1.0) as u8 as f64, s);
        }
        let pred = generated.split(&STOP[..]).next().unwrap_or("").trim();
        let exact = (pred == self.target.trim()) as u8 as f64;
        let found = self
            .answers
            .iter()
            .filter(|a| {
                pred.split(|c: char| !c.is_alphanumeric())
                    .any(|w| w == a.as_str())
            })
            .count();
        (exact, found as f64 / self.answers.len() as f64)
    }
}

/// What `data probes` writes; also a grid's `[probes]` section, written at `base.data.dir`
/// when no data set is there (unset fields at their defaults), mixed into the grid's
/// `[corpus]` or `[synth]` data set, which is then prepared at `mix_with`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, clap::Args)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct ProbesArgs {
    /// A prepared data set to mix the probes into (its tokenizer is used; its splits feed the
    /// text haystack).
    #[arg(long)]
    pub(crate) mix_with: Option<PathBuf>,
    /// Share of tokens that are probes when mixing (1: probes only).
    #[arg(long, value_parser = finite_flag, default_value_t = 1.0)]
    pub(crate) probe_fraction: f64,
    /// A tokenizer.json when there is no corpus; byte-level when omitted.
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Probe tasks, drawn uniformly per document.
    #[arg(long, value_delimiter = ',', default_value = "niah_single")]
    pub(crate) tasks: Vec<String>,
    /// Prompt lengths in tokens, drawn uniformly per document (depths are uniform in [0, 1]).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub(crate) lengths: Vec<usize>,
    /// Probe documents in the train split.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) train_docs: usize,
    /// Probe documents in the val split (drawn from a different seed).
    #[arg(long, default_value_t = 500)]
    pub(crate) val_docs: usize,
    /// Haystack: noise (RULER's sentences) or text (the mixed corpus).
    #[arg(long, default_value = "noise", value_parser = ["noise", "text"])]
    pub(crate) haystack: String,
    /// Seed of the documents (evaluation probes use eval.probe_seed, a different stream).
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Digits of magic numbers and pass keys.
    #[arg(long, default_value_t = ProbeSpec::default().digits)]
    pub(crate) digits: usize,
    /// Needles of the multi-key and multi-value tasks; variables per tracking chain.
    #[arg(long, default_value_t = ProbeSpec::default().needles)]
    pub(crate) needles: usize,
    /// Keys asked at once in MQAR.
    #[arg(long, default_value_t = ProbeSpec::default().queries)]
    pub(crate) queries: usize,
}

impl Default for ProbesArgs {
    fn default() -> Self {
        let p = ProbeSpec::default();
        ProbesArgs {
            mix_with: None,
            probe_fraction: 1.0,
            tokenizer: None,
            tasks: vec!["niah_single".into()],
            lengths: vec![256],
            train_docs: 20_000,
            val_docs: 500,
            haystack: "noise".into(),
            seed: 1,
            digits: p.digits,
            needles: p.needles,
            queries: p.queries,
        }
    }
}

impl ProbesArgs {
    /// Checks what can be checked before anything is written.
    pub(crate) fn validate(&self) -> Result<()> {
        for t in &self.tasks {
            Task::parse(t)?;
        }
        ensure!(
            self.haystack == "noise" || self.haystack == "text",
            "haystack = {:?}: allowed \"noise\" or \"text\"",
            self.haystack
        );
        self.spec().validate()
    }

    fn spec(&self) -> ProbeSpec {
        ProbeSpec {
            seed: self.seed,
            digits: self.digits,
            needles: self.needles,
            queries: self.queries,
            chat: None,
        }
    }

    /// Writes the data set at `out`.
    pub(crate) fn write(&self, out: &Path) -> Result<Meta> {
        self.validate()?;
        let tok = match &self.tokenizer {
            Some(p) => TextTokenizer::hf(p)?,
            None => TextTokenizer::Bytes,
        };
        let mix = MixSpec {
            tasks: self
                .tasks
                .iter()
                .map(|t| Task::parse(t))
                .collect::<Result<_>>()?,
            lengths: self.lengths.clone(),
            train_docs: self.train_docs,
            val_docs: self.val_docs,
            probe_fraction: self.probe_fraction,
            text_haystack: self.haystack == "text",
        };
        write_dataset(&self.spec(), &mix, tok, self.mix_with.as_deref(), out)
    }
}

/// A data set of probe documents, optionally mixed into a prepared corpus so small models
/// learn the probe format while they learn the language.
pub(crate) struct MixSpec {
    pub(crate) tasks: Vec<Task>,
    /// Each document's prompt length is drawn from these; its depth uniformly from [0, 1].
    pub(crate) lengths: Vec<usize>,
    pub(crate) train_docs: usize,
    pub(crate) val_docs: usize,
    /// Share of the tokens that are probes when a corpus is mixed in.
    pub(crate) probe_fraction: f64,
    /// Cut haystacks from the corpus (each split from its own split) instead of noise.
    pub(crate) text_haystack: bool,
}

/// Writes the data set: per split, probe documents, each followed by corpus tokens (in
/// corpus order, wrapping around) so probes make up `probe_fraction` of the tokens. The
/// tokenizer is the corpus's when there is one, else `tok`.
pub(crate) fn write_dataset(
    spec: &ProbeSpec,
    mix: &MixSpec,
    tok: TextTokenizer,
    corpus: Option<&Path>,
    out: &Path,
) -> Result<Meta> {
    spec.validate()?;
    ensure!(!mix.tasks.is_empty(), "no probe tasks given");
    ensure!(!mix.lengths.is_empty(), "no probe lengths given");
    ensure!(
        mix.train_docs >= 1 && mix.val_docs >= 1,
        "need at least one train and one val document"
    );
    ensure!(
        mix.probe_fraction > 0.0 && mix.probe_fraction <= 1.0,
        "probe fraction {} must be in (0, 1]",
        mix.probe_fraction
    );
    let corpus = match corpus {
        Some(dir) => {
            let meta = read_meta(dir)?;
            Some((dir, meta))
        }
        None => None,
    };
    ensure!(
        corpus.is_some() || (!mix.text_haystack && mix.probe_fraction == 1.0),
        "a text haystack or a probe fraction below 1 needs a corpus to mix with"
    );
    let tok = match &corpus {
        Some((dir, meta)) => tokenizer_of(dir, meta)?,
        None => tok,
    };
    prepare_out_dir(out)?;
    let vocab = tok.vocab_size();
    let mut splits = Vec::new();
    for (split, docs, salt) in [
        ("train", mix.train_docs, 0x7A1Eu64),
        ("val", mix.val_docs, 0x5EEDu64),
    ] {
        let stream = match &corpus {
            Some((dir, meta)) => Split::open(dir, meta, split)?.all_tokens(),
            None => Vec::new(),
        };
        let hay = if mix.text_haystack {
            Haystack::Text(stream.clone())
        } else {
            Haystack::Noise
        };
        let spec = ProbeSpec {
            seed: spec.seed ^ salt,
            ..spec.clone()
        };
        let mut rng = Rng::new(spec.seed);
        let mut w = ShardWriter::new(
            out,
            split,
            TOKENS_MAGIC,
            Width::for_vocab(vocab),
            100_000_000,
        );
        let mut cursor = 0usize;
        for i in 0..docs {
            let task = mix.tasks[rng.below(mix.tasks.len() as u64) as usize];
            let length = mix.lengths[rng.below(mix.lengths.len() as u64) as usize];
            let depth = rng.uniform();
            let doc = generate(task, &spec, &hay, &tok, length, depth, i as u64)?.document(&tok)?;
            let extra = (doc.len() as f64 * (1.0 - mix.probe_fraction) / mix.probe_fraction).round()
                as usize;
            for t in doc {
                w.push(t)?;
            }
            if extra > 0 && !stream.is_empty() {
                for _ in 0..extra {
                    w.push(stream[cursor])?;
                    cursor = (cursor + 1) % stream.len();
                }
                if let Some(e) = tok.eot() {
                    w.push(e)?;
                }
            }
        }
        splits.push(w.finish()?);
    }
    let val = splits.pop().expect("val");
    let train = splits.pop().expect("train");
    let docs = ProbeDocs {
        digits: spec.digits,
        needles: spec.needles,
        queries: spec.queries,
    };
    finish_text_dataset(out, &tok, train, val, Some(docs), None)
}

/// Tokens to generate for `probes`: room for the longest target, its stop character and a
/// little more; RULER's tasks get at least RULER's budget.
pub(crate) fn max_new_tokens(task: Task, probes: &[Probe], tok: &TextTokenizer) -> Result<usize> {
    let mut max_new = match task {
        Task::Ruler(r) => r.tokens_to_generate(),
        _ => 0,
    };
    for p in probes {
        max_new = max_new.max(tok.encode(&format!("{}.", p.target))?.len() + 2);
    }
    Ok(max_new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::BYTE_EOT;

    fn text(tok: &TextTokenizer, ids: &[u32]) -> String {
        tok.decode(ids)
    }

    /// Each generator is deterministic for a seed, hits the length exactly, places the
    /// needle at the depth, and its answer can be read back from the prompt text.
    #[test]
    fn probes_are_deterministic_exact_length_and_answerable() {
        let tok = TextTokenizer::Bytes;
        let spec = ProbeSpec::default();
        let corpus: Vec<u32> = "Once upon a time there was a quiet village by the sea. "
            .bytes()
            .cycle()
            .take(5000)
            .map(u32::from)
            .collect();
        for hay in [Haystack::Noise, Haystack::Text(corpus)] {
            for task in TASKS {
                for (length, depth) in [(400, 0.0), (700, 0.5), (1000, 1.0)] {
                    let p = generate(task, &spec, &hay, &tok, length, depth, 3).unwrap();
                    assert_eq!(
                        p,
                        generate(task, &spec, &hay, &tok, length, depth, 3).unwrap()
                    );
                    assert_ne!(
                        p,
                        generate(task, &spec, &hay, &tok, length, depth, 4).unwrap()
                    );
                    assert_eq!(p.prompt.len(), length, "{task:?}");
                    let prompt = text(&tok, &p.prompt);
                    if task.has_depth() {
                        // Snapped to a sentence start at most one noise sentence away.
                        assert!(
                            (p.depth - depth).abs() < 25.0 / 250.0,
                            "{task:?}: {} for {depth}",
                            p.depth
                        );
                        let needle = text(&tok, &p.prompt[p.needle_at..]);
                        let head = match task {
                            Task::Passkey => " The pass key is ",
                            Task::VariableTracking => " VAR ",
                            _ => " The magic number for ",
                        };
                        assert!(needle.starts_with(head), "{task:?}: {needle}");
                    }
                    assert_eq!(recover(task, &prompt), p.target, "{task:?}\n{prompt}");
                    let (em, recall) = p.score(&format!("{}. and more", p.target));
                    assert_eq!((em, recall), (1.0, 1.0));
                    let doc = p.document(&tok).unwrap();
                    assert_eq!(&doc[..length], &p.prompt[..]);
                    assert_eq!(doc.last(), Some(&BYTE_EOT));
                }
            }
        }
        assert!(generate(
            Task::NiahMultikey,
            &spec,
            &Haystack::Noise,
            &tok,
            100,
            0.5,
            0
        )
        .is_err());
    }

    /// An independent solver: reads the answer of a probe from its prompt text.
    fn recover(task: Task, prompt: &str) -> String {
        let question = prompt.rsplit("\nQuestion: ").next().unwrap();
        let find_all = |pattern: &str| -> Vec<String> {
            prompt
                .match_indices(pattern)
                .map(|(i, _)| {
                    prompt[i + pattern.len()..]
                        .split(|c: char| !c.is_ascii_alphanumeric())
                        .next()
                        .unwrap()
                        .to_string()
                })
                .collect()
        };
        let answers: Vec<String> = match task {
            Task::NiahSingle | Task::NiahMultikey | Task::NiahMultivalue => {
                let key = question
                    .trim_start_matches("the magic number for ")
                    .trim_start_matches("the magic numbers for ")
                    .trim_end_matches(" is")
                    .trim_end_matches(" are");
                find_all(&format!("The magic number for {key} is "))
            }
            Task::Passkey => find_all("The pass key is "),
            Task::Mqar => question
                .trim_end_matches('?')
                .split(", ")
                .map(|k| find_all(&format!(" {k}: "))[0].clone())
                .collect(),
            Task::VariableTracking => {
                let v = question
                    .trim_start_matches("the variables holding ")
                    .trim_end_matches(" are");
                let mut names = find_all("VAR ")
                    .into_iter()
                    .filter(|n| prompt.contains(&format!("VAR {n} = {v}.")))
                    .collect::<Vec<_>>();
                names.dedup();
                // Follow the chain: VAR B = VAR A.
                loop {
                    let last = names.last().unwrap().clone();
                    let pat = format!(" = VAR {last}.");
                    let Some(i) = prompt.find(&pat) else { break };
                    let before = &prompt[..i];
                    names.push(before.rsplit("VAR ").next().unwrap().to_string());
                }
                names
            }
            Task::Ruler(_) => unreachable!("RULER's tasks have their own tests"),
        };
        format!(" {}", answers.join(", "))
    }

    #[test]
    fn scoring_cuts_at_stop_and_counts_answers() {
        let p = Probe {
            task: Task::NiahMultivalue,
            prompt: vec![],
            target: " 12, 34".into(),
            answers: vec!["12".into(), "34".into()],
            needle_at: 0,
            depth: 0.0,
            spans: vec![],
        };
        assert_eq!(p.score(" 12, 34.\nQuestion"), (1.0, 1.0));
        assert_eq!(p.score(" 34, 12"), (0.0, 1.0));
        assert_eq!(p.score(" 12, 3"), (0.0, 0.5));
        assert_eq!(p.score(" 1234"), (0.0, 0.0));
        assert_eq!(p.score(".12, 34"), (0.0, 0.0));
    }

    /// A probe's spans hold what its answer rests on: each needle's tokens (the answer among
    /// them) and the question, to the prompt's end, in order and inside the prompt; for every
    /// task family (the project's, MQAR's pairs, RULER's).
    #[test]
    fn spans_cover_the_needles_and_the_question() {
        let tok = TextTokenizer::Bytes;
        let spec = ProbeSpec::default();
        for name in [
            "niah_single",
            "niah_multikey",
            "mqar",
            "niah_single_1",
            "vt",
        ] {
            let task = Task::parse(name).unwrap();
            let p = generate(task, &spec, &Haystack::Noise, &tok, 2048, 0.5, 0).unwrap();
            let last = p.spans.last().unwrap();
            assert_eq!(
                last.1,
                p.prompt.len(),
                "{name}: the question ends the prompt"
            );
            assert!(
                p.spans.windows(2).all(|w| w[0].1 <= w[1].0),
                "{name}: {:?}",
                p.spans
            );
            let text = |(a, b): (usize, usize)| tok.decode(&p.prompt[a..b]);
            let inside: String = p.spans[..p.spans.len() - 1]
                .iter()
                .map(|&s| text(s))
                .collect();
            for answer in &p.answers {
                assert!(
                    inside.contains(answer.as_str()),
                    "{name}: {answer} not in {inside:?}"
                );
            }
            let covered: usize = p.spans.iter().map(|(a, b)| b - a).sum();
            assert!(
                covered < p.prompt.len() / 2,
                "{name}: spans cover {covered} tokens"
            );
        }
    }
}
