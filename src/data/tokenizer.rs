//! How text becomes tokens: bytes (256 = end of document) or a Hugging Face
//! `tokenizer.json`, and the record a text data set keeps of its tokenizer.

use super::meta::{write_meta, CorpusRecord, Meta, ProbeDocs, META_FORMAT};
use crate::util::atomic;
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};

/// Byte-level tokenizer: token = byte value, 256 = end of document.
pub(crate) const BYTE_EOT: u32 = 256;

/// How text becomes tokens: bytes, or a Hugging Face `tokenizer.json`.
pub(crate) enum TextTokenizer {
    Bytes,
    Hf {
        tokenizer: Box<tokenizers::Tokenizer>,
        path: PathBuf,
    },
}

/// A chat template rendered around one user message: the text before the message, and after
/// it up to where the assistant's answer begins.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ChatWrap {
    pub(crate) head: String,
    pub(crate) tail: String,
}

/// The tokenizer a data set was prepared with.
pub(crate) fn tokenizer_of(dir: &Path, meta: &Meta) -> Result<TextTokenizer> {
    match meta.tokenizer.as_str() {
        "byte" => Ok(TextTokenizer::Bytes),
        "tokenizer.json" => TextTokenizer::hf(&dir.join("tokenizer.json")),
        other => bail!(
            "data set {} was not prepared from text (tokenizer {other:?}); probes and multiple-choice tasks need a byte-level or tokenizer.json data set",
            dir.display()
        ),
    }
}

/// The largest `tokenizer.json` read (it is parsed whole, in memory).
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// End-of-document tokens of common tokenizers, in the order they are looked for.
const EOT_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

impl TextTokenizer {
    /// A `tokenizer.json`, read only when it is no larger than `MAX_TOKENIZER_BYTES`, and
    /// kept only when its ids run from 0 without a hole up to its entries (a shard's width and
    /// a model's vocabulary follow the count of entries).
    pub(crate) fn hf(path: &Path) -> Result<TextTokenizer> {
        let size = std::fs::metadata(path)
            .with_context(|| format!("cannot read the tokenizer {}", path.display()))?
            .len();
        ensure!(
            size <= MAX_TOKENIZER_BYTES,
            "{} holds {size} bytes, more than the {MAX_TOKENIZER_BYTES} a tokenizer.json may \
             (the largest published ones take about 35 MB): it is not a tokenizer",
            path.display()
        );
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            anyhow::anyhow!("{} is not a readable tokenizer.json: {e}", path.display())
        })?;
        let entries = tokenizer.get_vocab_size(true);
        let vocab = tokenizer.get_vocab(true);
        if let Some((token, &id)) = vocab.iter().max_by_key(|(_, &id)| id) {
            ensure!(
                (id as usize) < entries,
                "{} gives {token:?} the id {id}, but holds only {entries} tokens: its ids must \
                 run from 0 to {} (the file was edited or is damaged)",
                path.display(),
                entries - 1
            );
        }
        Ok(TextTokenizer::Hf {
            tokenizer: Box::new(tokenizer),
            path: path.to_path_buf(),
        })
    }

    /// The chat template of the `tokenizer_config.json` beside the `tokenizer.json`, rendered
    /// around one user message with the generation prompt, as transformers'
    /// `apply_chat_template(..., add_generation_prompt=True)` renders it (Jinja, through
    /// minijinja): the text before the message and the text after it.
    pub(crate) fn chat_wrap(&self) -> Result<ChatWrap> {
        let TextTokenizer::Hf { path, .. } = self else {
            bail!("a byte-level tokenizer has no chat template: set eval.chat = false");
        };
        let cfg_path = path.with_file_name("tokenizer_config.json");
        let cfg: serde_json::Value = std::fs::read_to_string(&cfg_path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .with_context(|| format!("eval.chat = true needs the chat template of {}, which is missing or unreadable (convert writes it beside tokenizer.json; data prepare copies it)", cfg_path.display()))?;
        let template = cfg["chat_template"].as_str().with_context(|| {
            format!(
                "{} has no chat_template: set eval.chat = false",
                cfg_path.display()
            )
        })?;
        const MARK: &str = "\u{1}MESSAGE\u{1}";
        let mut env = minijinja::Environment::new();
        env.add_template("chat", template).with_context(|| {
            format!(
                "the chat template of {} is not valid Jinja",
                cfg_path.display()
            )
        })?;
        let text = |k: &str| cfg[k].as_str().unwrap_or("").to_string();
        let rendered = env
            .get_template("chat")?
            .render(minijinja::context! {
                messages => vec![minijinja::context! { role => "user", content => MARK }],
                add_generation_prompt => true,
                bos_token => text("bos_token"),
                eos_token => text("eos_token"),
            })
            .with_context(|| format!("rendering the chat template of {}", cfg_path.display()))?;
        let (head, tail) = rendered.split_once(MARK).with_context(|| {
            format!(
                "the chat template of {} does not show the user's message",
                cfg_path.display()
            )
        })?;
        Ok(ChatWrap {
            head: head.to_string(),
            tail: tail.to_string(),
        })
    }

    pub(crate) fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Bytes => 257,
            TextTokenizer::Hf { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    pub(crate) fn eot(&self) -> Option<u32> {
        match self {
            TextTokenizer::Bytes => Some(BYTE_EOT),
            TextTokenizer::Hf { tokenizer, .. } => {
                EOT_NAMES.iter().find_map(|n| tokenizer.token_to_id(n))
            }
        }
    }

    /// The token the tokenizer puts before a text when asked for its special tokens (Llama's
    /// `<s>`, `<|begin_of_text|>`), found by encoding with and without them; None for
    /// byte-level and for tokenizers that add none (Qwen, GPT-2).
    pub(crate) fn bos(&self) -> Option<u32> {
        let TextTokenizer::Hf { tokenizer, .. } = self else {
            return None;
        };
        let with = tokenizer.encode("a", true).ok()?;
        let without = tokenizer.encode("a", false).ok()?;
        let (with, without) = (with.get_ids(), without.get_ids());
        (with.len() > without.len() && with[1..].starts_with(without)).then(|| with[0])
    }

    /// The text of token `id` in the vocabulary (`</s>`); None for byte-level.
    pub(crate) fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            TextTokenizer::Bytes => None,
            TextTokenizer::Hf { tokenizer, .. } => tokenizer.id_to_token(id),
        }
    }

    /// The special token `tokenizer_config.json` declares under `key` (`bos_token`,
    /// `eos_token`: a string or an added token's `content`), as transformers'
    /// `tokenizer.bos_token_id` gives it, whether or not the tokenizer adds it to a text
    /// (SmolLM2 declares `<|im_start|>` and adds nothing); None without a declaration or for
    /// byte-level.
    pub(crate) fn declared(&self, key: &str) -> Option<u32> {
        let TextTokenizer::Hf { tokenizer, path } = self else {
            return None;
        };
        let text = std::fs::read_to_string(path.with_file_name("tokenizer_config.json")).ok()?;
        let cfg: serde_json::Value = serde_json::from_str(&text).ok()?;
        let token = &cfg[key];
        let name = token.as_str().or_else(|| token["content"].as_str())?;
        tokenizer.token_to_id(name)
    }

    /// Tokens of `text` with the tokenizer's special tokens added as its post-processor
    /// says (a BOS first, for most), as Hugging Face's `tokenizer(text)` gives them.
    pub(crate) fn encode_with_special(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            TextTokenizer::Hf { tokenizer, path } => Ok(tokenizer
                .encode(text, true)
                .map_err(|e| anyhow::anyhow!("tokenizing with {}: {e}", path.display()))?
                .get_ids()
                .to_vec()),
        }
    }

    /// Text of `ids`; a byte-level end of document ends it.
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        match self {
            TextTokenizer::Bytes => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .take_while(|&&t| t < 256)
                    .map(|&t| t as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            TextTokenizer::Hf { tokenizer, .. } => tokenizer.decode(ids, false).unwrap_or_default(),
        }
    }

    /// Tokens of `text`, without special tokens.
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            TextTokenizer::Bytes => Ok(text.bytes().map(u32::from).collect()),
            TextTokenizer::Hf { tokenizer, path } => Ok(tokenizer
                .encode(text, false)
                .map_err(|e| anyhow::anyhow!("tokenizing with {}: {e}", path.display()))?
                .get_ids()
                .to_vec()),
        }
    }
}

/// Writes a text data set's tokenizer record and, last, its `meta.json`, given the shard
/// names and token counts of each split.
pub(crate) fn finish_text_dataset(
    out: &Path,
    tok: &TextTokenizer,
    (train, train_tokens): (Vec<String>, u64),
    (val, val_tokens): (Vec<String>, u64),
    probes: Option<ProbeDocs>,
    corpus: Option<CorpusRecord>,
) -> Result<Meta> {
    let tokenizer = match tok {
        TextTokenizer::Bytes => "byte".to_string(),
        TextTokenizer::Hf { path, .. } => {
            // The data set keeps its tokenizer (and its chat template), so it describes itself.
            atomic::write_bytes(&out.join("tokenizer.json"), &std::fs::read(path)?)?;
            let config = path.with_file_name("tokenizer_config.json");
            if config.is_file() {
                atomic::write_bytes(&out.join("tokenizer_config.json"), &std::fs::read(config)?)?;
            }
            "tokenizer.json".to_string()
        }
    };
    let meta = Meta {
        format: META_FORMAT,
        tokenizer,
        vocab_size: tok.vocab_size(),
        eot_token: tok.eot(),
        train,
        val,
        train_tokens,
        val_tokens,
        synth: None,
        probes,
        corpus,
        shards_sha256: None,
    };
    write_meta(out, &meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer whose ids leave holes (1000 or 70,000 among 3 entries) is refused by
    /// name, before a data set is written with a width and vocabulary its ids exceed.
    #[test]
    fn a_tokenizer_whose_ids_exceed_its_entries_is_refused() {
        let dir = crate::util::scratch_dir("tokenizer-ids");
        let path = dir.join("tokenizer.json");
        let write = |top: u32| {
            let json = format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
                "normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,
                "decoder":null,"model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"a":1,"b":{top}}},
                "unk_token":"[UNK]"}}}}"#
            );
            std::fs::write(&path, json).unwrap();
        };
        write(2);
        assert_eq!(TextTokenizer::hf(&path).unwrap().vocab_size(), 3);
        for top in [1000, 70_000] {
            write(top);
            let e = format!("{:#}", TextTokenizer::hf(&path).err().expect("refused"));
            assert!(
                e.contains(&format!(
                    "gives \"b\" the id {top}, but holds only 3 tokens"
                )),
                "{e}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// SmolLM2's chat template, rendered around a user message as transformers renders it
    /// (its system prompt first, since the conversation has none); a tokenizer without a
    /// template is refused by name.
    #[test]
    fn the_chat_template_wraps_a_user_message() {
        let dir = std::env::temp_dir().join(format!("attnsweep-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tokenizer = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0, "<unk>": 1}, "unk_token": "<unk>"}}"#;
        std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
        let template = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let config = serde_json::json!({"chat_template": template, "eos_token": "<|im_end|>"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = TextTokenizer::hf(&dir.join("tokenizer.json")).unwrap();
        let wrap = tok.chat_wrap().unwrap();
        assert_eq!(
            wrap.head,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n"
        );
        assert_eq!(wrap.tail, "<|im_end|>\n<|im_start|>assistant\n");
        std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
        let e = format!("{:#}", tok.chat_wrap().unwrap_err());
        assert!(e.contains("has no chat_template"), "{e}");
        assert!(TextTokenizer::Bytes.chat_wrap().is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
