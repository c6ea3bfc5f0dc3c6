//! The tokenizer, built from GGUF metadata alone (no weights, no hub).
//!
//! Byte-level BPE from `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`,
//! digits split one by one, no prefix space, and every control token
//! (`token_type == 3`) added as a special token, so `<|im_start|>` is never
//! followed by a spurious `Ġ`.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use crate::chat::{ChatMessage, ChatTemplate};
use crate::detok::TokenBytes;
use crate::error::{Result, TextError};
use crate::gguf::{Header, Value};
use crate::metadata::Metadata;
use crate::segments::{SegmentCache, SegmentStats, MIN_SEGMENT_BYTES};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// A GGUF tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    bos: Option<u32>,
    eos: u32,
    add_bos: bool,
    chat: Option<ChatTemplate>,
    /// Tokens of recurring long segments (off unless asked for).
    segments: Option<SegmentCache>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Reads only the GGUF header of `path` (fast: no tensor data is touched).
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let header = Header::read_file(path).map_err(|e| TextError::reading(path, e))?;
        Self::from_gguf(&header)
    }

    /// Builds the tokenizer from parsed GGUF metadata.
    pub fn from_gguf(content: &Header) -> Result<Self> {
        let md = Metadata(&content.metadata);
        let model = md.string("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TextError::Unsupported(format!(
                "tokenizer model `{model}` (only byte-level BPE, `gpt2`, is supported)"
            )));
        }
        let tokens = strings(md.array("tokenizer.ggml.tokens")?, "tokens")?;
        let merges = strings(md.array("tokenizer.ggml.merges")?, "merges")?;
        let types = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => integers(v)?,
            None => vec![1; tokens.len()],
        };
        let eos = md.usize("tokenizer.ggml.eos_token_id")? as u32;
        let bos = md
            .opt_usize("tokenizer.ggml.bos_token_id")?
            .map(|b| b as u32);
        let add_bos = md.opt_bool("tokenizer.ggml.add_bos_token").unwrap_or(false);
        let inner = build_bpe(&tokens, &merges, &types)?;
        let special: Vec<bool> = types.iter().map(|&t| t == TYPE_CONTROL).collect();
        let bytes = token_bytes(&tokens, &special);
        let name = |id: Option<u32>| {
            id.and_then(|i| tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let chat = md
            .opt_string("tokenizer.chat_template")
            .map(|src| ChatTemplate::new(&src, &name(bos), &name(Some(eos))))
            .transpose()?;
        if eos as usize >= tokens.len() || bos.is_some_and(|b| b as usize >= tokens.len()) {
            return Err(TextError::InvalidModel(
                "BOS/EOS id outside the vocabulary".into(),
            ));
        }
        Ok(Self {
            inner,
            bytes,
            special,
            bos,
            eos,
            add_bos,
            chat,
            segments: None,
        })
    }

    /// Keeps the tokens of long text segments that recur (between control
    /// tokens: a shared system prompt, a chat's earlier turns) in up to
    /// `budget_bytes`, so that [`Tokenizer::encode`] does not tokenize them
    /// again; 0 keeps none. See [`crate::segments`].
    pub fn with_segment_cache(mut self, budget_bytes: usize) -> Result<Self> {
        self.segments = match budget_bytes {
            0 => None,
            n => {
                let controls: Vec<String> = (self.bytes.iter().zip(&self.special))
                    .filter(|(_, &sp)| sp)
                    .map(|(b, _)| String::from_utf8_lossy(b).into_owned())
                    .collect();
                Some(SegmentCache::new(&controls, n, MIN_SEGMENT_BYTES)?)
            }
        };
        Ok(self)
    }

    /// How the segment cache has done (`None` when it is off).
    pub fn segment_stats(&self) -> Option<SegmentStats> {
        self.segments.as_ref().map(SegmentCache::stats)
    }

    /// Token ids for `text`. Special tokens written in the text are recognised;
    /// `add_special_tokens` prepends BOS when the model asks for it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_special_tokens && self.add_bos {
            ids.extend(self.bos);
        }
        match &self.segments {
            Some(cache) => ids.extend(cache.encode(text, |t| self.encode_plain(t))?),
            None => ids.extend(self.encode_plain(text)?),
        }
        Ok(ids)
    }

    /// Token ids for `text` from the tokenizer itself, without the cache.
    fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text for `ids`; invalid UTF-8 becomes U+FFFD. Unknown ids are an error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let mut buf = Vec::new();
        for &id in ids {
            if skip_special_tokens && self.is_special(id) {
                continue;
            }
            let b = self.bytes.get(id as usize).ok_or_else(|| {
                TextError::InvalidInput(format!("token id {id} is outside the vocabulary"))
            })?;
            buf.extend_from_slice(b);
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_token_id(&self) -> u32 {
        self.eos
    }

    /// Whether `encode(.., true)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// Renders `messages` with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| {
            TextError::ChatTemplate("the model file has no tokenizer.chat_template".into())
        })?;
        chat.render(messages, add_generation_prompt)
    }
}

impl TokenBytes for Tokenizer {
    fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.bytes.get(id as usize).cloned()
    }
}

fn strings(values: &[Value], what: &str) -> Result<Vec<String>> {
    values
        .iter()
        .map(|v| {
            v.as_str().map(str::to_string).ok_or_else(|| {
                TextError::InvalidModel(format!("tokenizer {what} holds {v:?}, not a string"))
            })
        })
        .collect()
}

fn integers(v: &Value) -> Result<Vec<i64>> {
    let items = v
        .as_array()
        .ok_or_else(|| TextError::InvalidModel("tokenizer token_type is not an array".into()))?;
    items
        .iter()
        .map(|x| {
            x.as_i64()
                .ok_or_else(|| TextError::InvalidModel(format!("tokenizer token_type holds {x:?}")))
        })
        .collect()
}

fn build_bpe(tokens: &[String], merges: &[String], types: &[i64]) -> Result<tokenizers::Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| TextError::InvalidModel(format!("malformed merge `{m}`")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| TextError::InvalidModel(format!("BPE: {e}")))?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let pre: Vec<PreTokenizerWrapper> = vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ];
    tk.with_pre_tokenizer(Some(Sequence::new(pre)));
    let added = |ty: i64, special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(types)
            .filter(|(_, &t)| t == ty)
            .map(|(s, _)| AddedToken::from(s.clone(), special))
            .collect()
    };
    tk.add_special_tokens(&added(TYPE_CONTROL, true));
    tk.add_tokens(&added(TYPE_USER_DEFINED, false));
    Ok(tk)
}

/// The raw bytes of each token: byte-level characters mapped back to bytes;
/// special tokens are their literal text.
fn token_bytes(tokens: &[String], special: &[bool]) -> Vec<Vec<u8>> {
    let unicode_to_byte: HashMap<char, u8> = byte_level_chars()
        .into_iter()
        .enumerate()
        .map(|(b, c)| (c, b as u8))
        .collect();
    tokens
        .iter()
        .zip(special)
        .map(|(t, &sp)| match sp {
            true => t.as_bytes().to_vec(),
            false => t
                .chars()
                .flat_map(|c| match unicode_to_byte.get(&c) {
                    Some(b) => vec![*b],
                    None => c.to_string().into_bytes(),
                })
                .collect(),
        })
        .collect()
}

/// GPT-2's printable stand-in for each byte value (index = byte).
pub fn byte_level_chars() -> Vec<char> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let code = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(code).unwrap_or('\u{fffd}')
        })
        .collect()
}
