//! Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores them: the
//! items of a JSONL file, each choice's summed log-likelihood after the context (and whether
//! it is the greedy continuation), accuracy and length-normalised accuracy, and the logged
//! samples in the harness's shape.

use crate::data::TextTokenizer;
use crate::model::attention::ForwardCtx;
use crate::model::Llama;
use crate::util::atomic;
use crate::util::progress::{Progress, DEFAULT_STATUS_EVERY};
use crate::util::rng::Rng;
use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// One line of a multiple-choice JSONL file (lm-evaluation-harness's fields).
#[derive(Deserialize, Clone, Debug)]
#[serde(deny_unknown_fields)]
pub struct McItem {
    pub(crate) context: String,
    pub(crate) choices: Vec<String>,
    pub(crate) gold: usize,
    /// Put between the context and each choice (the harness's default is a space).
    #[serde(default = "space")]
    pub(crate) target_delimiter: String,
}

fn space() -> String {
    " ".into()
}

pub fn read_mc(path: &Path) -> Result<Vec<McItem>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read multiple-choice file {}", path.display()))?;
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let item: McItem = serde_json::from_str(line).with_context(|| {
            format!(
                "{}: expected {{\"context\": str, \"choices\": [str], \"gold\": int}}",
                at()
            )
        })?;
        let n = item.choices.len();
        ensure!(n > 0, "{}: the item has no choices", at());
        ensure!(
            n >= 2,
            "{}: the item has one choice; scoring needs at least 2 choices",
            at()
        );
        if let Some(k) = item.choices.iter().position(|c| c.is_empty()) {
            bail!("{}: choice {k} is empty (no text to score)", at());
        }
        ensure!(
            item.gold < n,
            "{}: gold = {} but the item has {n} choices (gold counts from 0)",
            at(),
            item.gold
        );
        items.push(item);
    }
    ensure!(!items.is_empty(), "{} holds no items", path.display());
    Ok(items)
}

/// The length of `s` without its trailing whitespace as Python's `str.rstrip()` sees it:
/// Unicode's White_Space (what Rust's `trim_end` strips) and the separators U+001C..U+001F.
pub(super) fn rstripped_len(s: &str) -> usize {
    s.trim_end_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
        .len()
}

/// Tokens of `text` as the harness's `tok_encode` gives them by default: with the
/// tokenizer's special tokens (a BOS first, for tokenizers that add one), unless the text
/// already begins with the prefix token's text.
fn harness_encode(tok: &TextTokenizer, text: &str) -> Result<Vec<u32>> {
    let prefix_text = tok.bos().or(tok.eot()).map(|t| tok.decode(&[t]));
    match prefix_text {
        Some(p) if !p.is_empty() && text.starts_with(&p) => tok.encode(text),
        _ => tok.encode_with_special(text),
    }
}

/// Context and continuation tokens as lm-evaluation-harness makes them for a causal model
/// (`TemplateLM.loglikelihood` and `_encode_pair`, 0.4.9.2 and later, where `add_bos_token`
/// is unset by default and the tokenizer's own special tokens are used): an empty context is
/// the prefix token alone (the tokenizer's declared BOS, else the BOS it adds, else its
/// end-of-text token), before the
/// continuation encoded without special tokens, unless that begins with the prefix token
/// itself; otherwise trailing whitespace of the context moves to the continuation, the pair
/// and the context are each encoded (`harness_encode`), and the continuation is what follows
/// the context's own encoding.
pub(super) fn encode_pair(
    tok: &TextTokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    // The harness's prefix token: the tokenizer's declared BOS (`bos_token_id`), else the one
    // its post-processor adds, else its end of text.
    let prefix = || {
        tok.declared("bos_token")
            .or(tok.bos())
            .or(tok.eot())
            .context("an empty context needs a tokenizer with a beginning- or end-of-text token")
    };
    if context.is_empty() {
        let p = prefix()?;
        let mut cont = tok.encode(continuation)?;
        if cont.first() == Some(&p) {
            let rest = cont.split_off(1);
            return Ok((cont, rest));
        }
        return Ok((vec![p], cont));
    }
    let n = rstripped_len(context);
    let continuation = format!("{}{continuation}", &context[n..]);
    let context = &context[..n];
    let whole = harness_encode(tok, &format!("{context}{continuation}"))?;
    let mut ctx = harness_encode(tok, context)?;
    let cont = whole[ctx.len().min(whole.len())..].to_vec();
    if ctx.is_empty() {
        // A context of whitespace alone, with a tokenizer that adds nothing before text:
        // the first continuation token needs something to be predicted from.
        ctx.push(prefix()?);
    }
    Ok((ctx, cont))
}

/// One choice scored: the sum of its tokens' log-likelihoods, and whether each of them is
/// the model's most likely next token (the harness's `is_greedy`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ChoiceScore {
    pub(crate) loglik: f64,
    pub(crate) greedy: bool,
}

/// Each choice's score after the context. Inputs longer than `max_len` lose the start of
/// their context. `gate_seed` seeds context-free (Bernoulli) gates.
pub(crate) fn choice_logliks(
    model: &Llama,
    tok: &TextTokenizer,
    item: &McItem,
    max_len: usize,
    device: Device,
    gate_seed: u64,
) -> Result<Vec<ChoiceScore>> {
    let mut seqs = Vec::new();
    for c in &item.choices {
        let (ctx, cont) =
            encode_pair(tok, &item.context, &format!("{}{c}", item.target_delimiter))?;
        ensure!(
            !cont.is_empty() && cont.len() < max_len,
            "choice {c:?} encodes to {} tokens; with eval.max_length = {max_len} (0: \
             data.seq_len) it may have 1 ..= {}",
            cont.len(),
            max_len - 1
        );
        let mut ids: Vec<i64> = ctx.iter().chain(&cont).map(|&t| t as i64).collect();
        // The last token is only ever a target.
        let keep = (ids.len() - 1).min(max_len);
        ids = ids.split_off(ids.len() - keep - 1);
        seqs.push((ids, cont.len()));
    }
    let width = seqs.iter().map(|s| s.0.len()).max().expect("choices") - 1;
    // Right padding: causal attention keeps the real positions unaffected.
    let inputs: Vec<i64> = seqs
        .iter()
        .flat_map(|(ids, _)| {
            ids[..ids.len() - 1]
                .iter()
                .copied()
                .chain(std::iter::repeat(0))
                .take(width)
        })
        .collect();
    let x = Tensor::from_slice(&inputs)
        .view([seqs.len() as i64, width as i64])
        .to_device(device);
    let ctx = ForwardCtx {
        gate_seed,
        ..Default::default()
    };
    let logp = tch::no_grad(|| {
        model
            .forward(&x, &ctx)
            .logits
            .to_kind(Kind::Double)
            .log_softmax(-1, Kind::Double)
            .to_device(Device::Cpu)
    });
    let best = logp.argmax(-1, false);
    Ok(seqs
        .iter()
        .enumerate()
        .map(|(r, (ids, n_cont))| {
            let n = ids.len() - 1;
            let (r, targets) = (r as i64, n - n_cont..n);
            ChoiceScore {
                loglik: targets
                    .clone()
                    .map(|t| logp.double_value(&[r, t as i64, ids[t + 1]]))
                    .sum(),
                greedy: targets
                    .into_iter()
                    .all(|t| best.int64_value(&[r, t as i64]) == ids[t + 1]),
            }
        })
        .collect())
}

/// One item's result: every choice's score, the predictions by log-likelihood and by
/// log-likelihood per character, and whether each is the gold.
#[derive(Clone, Debug)]
pub(crate) struct McResult {
    pub(crate) scores: Vec<ChoiceScore>,
    pub(crate) prediction: usize,
    pub(crate) prediction_norm: usize,
    pub(crate) acc: f64,
    pub(crate) acc_norm: f64,
}

/// Scores every item: `acc` takes the choice of highest log-likelihood, `acc_norm` the
/// highest per character of the choice (ties to the first, as numpy's argmax does).
pub(crate) fn score_mc(
    model: &Llama,
    tok: &TextTokenizer,
    items: &[McItem],
    max_len: usize,
    device: Device,
    seed: u64,
    show: bool,
) -> Result<Vec<McResult>> {
    let every = Duration::from_secs(DEFAULT_STATUS_EVERY);
    let mut progress = Progress::new(items.len() as u64, "items", !show, every);
    let argmax = |v: &[f64]| {
        (0..v.len())
            .max_by(|&a, &b| v[a].total_cmp(&v[b]).then(b.cmp(&a)))
            .expect("choices")
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        // Each item draws its own context-free gates.
        let scores = choice_logliks(
            model,
            tok,
            item,
            max_len,
            device,
            Rng::derive(seed, &[i as u64]),
        )
        .with_context(|| format!("item {}", i + 1))?;
        let ll: Vec<f64> = scores.iter().map(|s| s.loglik).collect();
        let norm: Vec<f64> = ll
            .iter()
            .zip(&item.choices)
            .map(|(l, c)| l / c.chars().count() as f64)
            .collect();
        let (prediction, prediction_norm) = (argmax(&ll), argmax(&norm));
        out.push(McResult {
            scores,
            prediction,
            prediction_norm,
            acc: (prediction == item.gold) as u8 as f64,
            acc_norm: (prediction_norm == item.gold) as u8 as f64,
        });
        progress.update(i as u64 + 1, "");
    }
    progress.finish();
    Ok(out)
}

/// `samples_<task>.jsonl`: one line per item in the shape of lm-evaluation-harness's logged
/// samples (`doc`, `arguments`, `resps` of (log-likelihood, is_greedy), `acc`, `acc_norm`),
/// with the predictions.
pub(crate) fn write_mc_samples(path: &Path, items: &[McItem], results: &[McResult]) -> Result<()> {
    let mut text = String::new();
    for (i, (item, r)) in items.iter().zip(results).enumerate() {
        let resps: Vec<serde_json::Value> = r
            .scores
            .iter()
            .map(|s| serde_json::json!([s.loglik, s.greedy]))
            .collect();
        let line = serde_json::json!({
            "doc_id": i,
            "doc": {"context": item.context, "choices": item.choices, "gold": item.gold},
            "target": item.gold,
            "arguments": item.choices.iter().map(|c| [item.context.clone(), format!("{}{c}", item.target_delimiter)]).collect::<Vec<_>>(),
            "resps": resps.iter().map(|r| [r]).collect::<Vec<_>>(),
            "filtered_resps": resps,
            "prediction": r.prediction,
            "prediction_norm": r.prediction_norm,
            "acc": r.acc,
            "acc_norm": r.acc_norm,
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    atomic::write_bytes(path, text.as_bytes())
}
