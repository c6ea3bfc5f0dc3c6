//! Constrained decoding with llguidance: grammars in its Lark dialect (JSON
//! schemas embedded with `%json`), compiled against the model's vocabulary.
//!
//! [`Grammars`] is built once per process from the tokenizer: the token
//! trie comes from the token bytes the tokenizer already holds, so no second
//! tokenizer is loaded. The router compiles a request's grammar once to
//! reject a bad one with a 400; the worker that samples compiles it again
//! into a [`Constraint`], which masks the logits before each draw and
//! advances with each token drawn.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::detok::TokenBytes;
use crate::tokenizer::Tokenizer;

/// Why a grammar cannot be used.
#[derive(thiserror::Error, Debug, Clone, PartialEq)]
pub enum GrammarError {
    /// The vocabulary could not be turned into a token trie.
    #[error("cannot build the token trie: {0}")]
    Vocabulary(String),
    /// The grammar (or the JSON schema in it) does not compile.
    #[error("invalid grammar: {0}")]
    Invalid(String),
    /// The matcher refused a token or failed while computing a mask.
    #[error("constrained decoding failed: {0}")]
    Matcher(String),
}

/// The vocabulary as llguidance sees it: token bytes (special tokens behind
/// the trie's marker byte, so text never matches them) and the tokenizer
/// for literal strings in grammars.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let text = String::from_utf8_lossy(s);
        self.tokenizer.encode(&text, false).unwrap_or_default()
    }
}

/// Compiles grammars for one model's vocabulary; cheap to clone.
#[derive(Clone)]
pub struct Grammars {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// Builds the token trie of `tokenizer`'s vocabulary, padded with
    /// never-allowed tokens up to `vocab_size` (the logits' length) when the
    /// model's output layer is wider than the tokenizer.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize) -> Result<Self, GrammarError> {
        let n = tokenizer.vocab_size().max(vocab_size);
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                match (bytes, tokenizer.is_special(id)) {
                    (Some(b), false) => b,
                    (Some(b), true) => special(&b),
                    (None, _) => special(format!("<[{id}]>").as_bytes()),
                }
            })
            .collect();
        let info = TokRxInfo {
            tok_bos: tokenizer.bos_token_id(),
            ..TokRxInfo::new(n as u32, tokenizer.eos_token_id())
        };
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// Compiles `lark` into a fresh matcher at the start of the output.
    pub fn compile(&self, lark: &str) -> Result<Constraint, GrammarError> {
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(format!("{e:#}")))?;
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(GrammarError::Invalid(e)),
            None => Ok(Constraint { matcher }),
        }
    }

    /// Checks that `lark` compiles.
    pub fn check(&self, lark: &str) -> Result<(), GrammarError> {
        self.compile(lark).map(drop)
    }
}

/// A special token's trie entry: the marker byte, then its text.
fn special(text: &[u8]) -> Vec<u8> {
    let mut w = Vec::with_capacity(text.len() + 1);
    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
    w.extend_from_slice(text);
    w
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Sets the logit of every token the grammar forbids next to −∞. Once
    /// the grammar is complete only end-of-sequence stays allowed.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Matcher(format!("{e:#}")))?;
        for (id, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(id as TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past `token` (sampled under [`Constraint::mask`], or
    /// generated before a migration).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(format!("{e:#}")))
    }

    /// Whether the output so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}
