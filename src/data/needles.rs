//! What every probe is built from: RULER's noise haystack and a corpus window as haystacks,
//! the words keys are made of, random numbers and names, and the placement of needles in a
//! haystack at a depth.

use super::tokenizer::TextTokenizer;
use crate::util::rng::Rng;
use anyhow::{ensure, Result};

/// RULER's noise haystack: these sentences, repeated.
pub(crate) const NOISE: [&str; 5] = [
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
];

/// Words keys are made of (two joined by a hyphen: 4096 keys).
pub(crate) const WORDS: [&str; 64] = [
    "amber", "basil", "cedar", "delta", "ember", "fable", "grove", "haven", "ivory", "jolly",
    "karma", "lemon", "maple", "noble", "ocean", "pearl", "quill", "raven", "sable", "tulip",
    "umber", "vivid", "willow", "xenon", "yacht", "zephyr", "acorn", "bloom", "coral", "dune",
    "eagle", "frost", "glade", "heron", "inlet", "jade", "kite", "lotus", "mirth", "north",
    "olive", "plume", "quartz", "ridge", "stone", "thorn", "unity", "vapor", "wheat", "yarrow",
    "zinc", "arbor", "brook", "cloud", "dawn", "elm", "flint", "gale", "hazel", "iris", "juniper",
    "knoll", "lark", "moss",
];

/// Where haystack tokens come from.
pub(crate) enum Haystack {
    Noise,
    /// A token stream (a prepared corpus split) to cut windows from.
    Text(Vec<u32>),
}

pub(crate) fn number(rng: &mut Rng, digits: usize) -> String {
    let lo = 10u64.pow(digits as u32 - 1);
    let hi = 10u64.pow(digits as u32);
    let lo = if digits == 1 { 0 } else { lo };
    (lo + rng.below(hi - lo)).to_string()
}

/// `n` distinct values of `draw`.
pub(crate) fn distinct(rng: &mut Rng, n: usize, draw: impl Fn(&mut Rng) -> String) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(n);
    while out.len() < n {
        let v = draw(rng);
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

pub(crate) fn key(rng: &mut Rng) -> String {
    let a = WORDS[rng.below(WORDS.len() as u64) as usize];
    let b = WORDS[rng.below(WORDS.len() as u64) as usize];
    format!("{a}-{b}")
}

pub(crate) fn variable(rng: &mut Rng) -> String {
    (0..5)
        .map(|_| (b'A' + rng.below(26) as u8) as char)
        .collect()
}

/// `budget` haystack tokens, and the offsets at which a needle may go (sentence starts for
/// the noise haystack, any token for text; the last is `budget`).
pub(crate) fn haystack_tokens(
    haystack: &Haystack,
    budget: usize,
    tok: &TextTokenizer,
    rng: &mut Rng,
) -> Result<(Vec<u32>, Vec<usize>)> {
    Ok(match haystack {
        Haystack::Noise => {
            let sentences: Vec<Vec<u32>> =
                NOISE.iter().map(|s| tok.encode(s)).collect::<Result<_>>()?;
            let (mut hay, mut starts) = (Vec::with_capacity(budget), Vec::new());
            for s in sentences.iter().cycle() {
                if hay.len() >= budget {
                    break;
                }
                starts.push(hay.len());
                hay.extend(s);
            }
            hay.truncate(budget);
            starts.push(budget);
            (hay, starts)
        }
        Haystack::Text(stream) => {
            ensure!(
                stream.len() >= budget,
                "the text haystack holds {} tokens, fewer than the {budget} a probe needs",
                stream.len()
            );
            let at = rng.below((stream.len() - budget + 1) as u64) as usize;
            (stream[at..at + budget].to_vec(), (0..=budget).collect())
        }
    })
}

/// Needles inserted into a haystack.
pub(crate) struct Placement {
    pub(crate) tokens: Vec<u32>,
    /// Where the needle `placed` starts.
    pub(crate) needle_at: usize,
    /// Haystack tokens before it over all haystack tokens: the depth asked, snapped to an
    /// insertion point.
    pub(crate) depth: f64,
    /// The needles' indices in the order they appear.
    pub(crate) order: Vec<usize>,
    /// Every needle's tokens, `[start, end)`, in the order they appear.
    pub(crate) spans: Vec<(usize, usize)>,
}

/// Inserts `needles` into `hay` at offsets among `starts`: needle `placed` at `depth`, the
/// others at random offsets (a chain's later links after it, in order).
pub(crate) fn place(
    hay: &[u32],
    starts: &[usize],
    needles: &[Vec<u32>],
    placed: usize,
    chain: bool,
    depth: f64,
    rng: &mut Rng,
) -> Placement {
    let budget = hay.len();
    let nearest = |x: f64| {
        *starts
            .iter()
            .min_by(|a, b| (**a as f64 - x).abs().total_cmp(&(**b as f64 - x).abs()))
            .expect("at least one insertion point")
    };
    let at_depth = nearest(depth * budget as f64);
    let mut offsets: Vec<usize> = (0..needles.len())
        .map(|i| {
            if i == placed {
                at_depth
            } else if chain && i > placed {
                let later: Vec<usize> = starts.iter().copied().filter(|&s| s >= at_depth).collect();
                later[rng.below(later.len() as u64) as usize]
            } else {
                starts[rng.below(starts.len() as u64) as usize]
            }
        })
        .collect();
    if chain {
        offsets[placed..].sort_unstable();
    }
    // Insert in haystack order; needles at one offset keep their index order.
    let mut order: Vec<usize> = (0..needles.len()).collect();
    order.sort_by_key(|&i| (offsets[i], i));
    let mut tokens = Vec::with_capacity(budget + needles.iter().map(Vec::len).sum::<usize>());
    let (mut from, mut needle_at) = (0, 0);
    let mut spans = Vec::with_capacity(needles.len());
    for &i in &order {
        tokens.extend(&hay[from..offsets[i]]);
        from = offsets[i];
        if i == placed {
            needle_at = tokens.len();
        }
        spans.push((tokens.len(), tokens.len() + needles[i].len()));
        tokens.extend(&needles[i]);
    }
    tokens.extend(&hay[from..]);
    Placement {
        tokens,
        needle_at,
        depth: at_depth as f64 / budget.max(1) as f64,
        order,
        spans,
    }
}
