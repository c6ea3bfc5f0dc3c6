//! The request front end: the tokenizer and chat template (read from the
//! GGUF file without its weights), and the checks that turn an OpenAI request
//! into prompts of token ids that fit the context window.

use std::path::Path;
use std::sync::Arc;

use pdserve_protocol::openai::{
    ChatCompletionRequest, CompletionRequest, MessageContent, PromptInput, RequestMessage,
};
use pdserve_text::generation::ModelSamplingDefaults;
use pdserve_text::grammar::Grammars;
use pdserve_text::{ChatMessage, ModelConfig, Tokenizer};

use crate::config::Limits;
use crate::defaults::SamplingDefaults;
use crate::error::ApiError;
use crate::params::{self, Params, Rules};
use crate::structured::{self, Structured};

/// One prompt to run `n` times.
#[derive(Debug, Clone)]
pub struct PromptPlan {
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    /// The prompt text, for completions' `echo`.
    pub echo: Option<String>,
}

/// A validated request.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub prompts: Vec<PromptPlan>,
    pub params: Params,
    /// Whether tool calls are parsed out of the output (chat with tools).
    pub parse_calls: bool,
}

pub struct Frontend {
    pub tokenizer: Arc<Tokenizer>,
    pub context_length: usize,
    pub vocab_size: usize,
    pub model_name: String,
    pub limits: Limits,
    /// What a request that leaves a sampling parameter out gets.
    pub defaults: SamplingDefaults,
    /// Compiles grammars to check them (None: the vocabulary could not be
    /// read into a token trie, and constrained requests are refused).
    pub grammars: Option<Grammars>,
}

impl Frontend {
    /// Reads the tokenizer, template and context length; the weights are not touched.
    pub fn load(path: &Path, model_name: String, limits: Limits) -> anyhow::Result<Self> {
        // One read of the header (it holds the whole vocabulary) for both.
        let header = pdserve_text::gguf::Header::read_file(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let tokenizer = Tokenizer::from_gguf(&header)?;
        let tokenizer = Arc::new(tokenizer.with_segment_cache(limits.tokenizer_cache_bytes)?);
        let config = ModelConfig::from_gguf(&header)?;
        let recommended = ModelSamplingDefaults::from_gguf(&header)?;
        drop(header);
        let defaults = SamplingDefaults::resolve(&limits.sampling, &recommended);
        tracing::info!(
            defaults = %serde_json::to_string(&defaults).unwrap_or_default(),
            "sampling defaults (a request's own values win)"
        );
        let grammars = match Grammars::new(tokenizer.clone(), config.vocab_size) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::warn!("constrained decoding is off: {e}");
                None
            }
        };
        Ok(Self {
            tokenizer,
            context_length: config.context_length,
            vocab_size: config.vocab_size,
            model_name,
            limits,
            defaults,
            grammars,
        })
    }

    fn rules(&self) -> Rules<'_> {
        Rules {
            limits: &self.limits,
            defaults: &self.defaults,
            vocab_size: self.vocab_size,
        }
    }

    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        match model == self.model_name {
            true => Ok(()),
            false => Err(ApiError::ModelNotFound(model.to_string())),
        }
    }

    pub fn prepare_chat(&self, req: &ChatCompletionRequest) -> Result<Prepared, ApiError> {
        self.check_model(&req.model)?;
        let logprobs = params::chat_logprobs(req.logprobs, req.top_logprobs)?;
        let max = req.max_completion_tokens.or(req.params.max_tokens);
        let mut params = params::parse(&req.params, max, logprobs, &self.rules())?;
        let structured = structured::plan(req, self.grammars.as_ref())?;
        params.sampling.grammar = structured.grammar.clone();
        let tokens = self.render_chat(&req.messages, true, &structured)?;
        let plan = self.plan(tokens, params.max_tokens, None)?;
        Ok(Prepared {
            prompts: vec![plan],
            params,
            parse_calls: structured.parse_calls,
        })
    }

    pub fn prepare_completion(&self, req: &CompletionRequest) -> Result<Prepared, ApiError> {
        self.check_model(&req.model)?;
        let logprobs = params::completion_logprobs(req.logprobs)?;
        let mut params =
            params::parse(&req.params, req.params.max_tokens, logprobs, &self.rules())?;
        let echo = req.echo.unwrap_or(false);
        // The API defines prompt logprobs for an echoed prompt only.
        params.sampling.prompt_logprobs = echo && logprobs != params::LogprobMode::None;
        let prompts = self.completion_prompts(&req.prompt)?;
        if prompts.len() as u64 * params.n as u64 > self.limits.max_n as u64 * 8 {
            return Err(ApiError::invalid(
                "prompt",
                "too many prompts × n in one request",
            ));
        }
        let prompts = prompts
            .into_iter()
            .map(|tokens| {
                let text = echo.then(|| self.detokenize(&tokens)).transpose()?;
                self.plan(tokens, params.max_tokens, text)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Prepared {
            prompts,
            params,
            parse_calls: false,
        })
    }

    /// Renders the chat template and tokenizes the result.
    pub fn chat_tokens(
        &self,
        messages: &[RequestMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ApiError> {
        self.render_chat(messages, add_generation_prompt, &Structured::default())
    }

    /// Renders the chat template, with the tools described in the system
    /// message, and tokenizes the result.
    fn render_chat(
        &self,
        messages: &[RequestMessage],
        add_generation_prompt: bool,
        structured: &Structured,
    ) -> Result<Vec<u32>, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        let mut messages = messages
            .iter()
            .map(message_text)
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(tools) = &structured.tools_prompt {
            match messages.first_mut() {
                Some(m) if m.role == "system" => {
                    m.content = format!("{}\n\n{tools}", m.content);
                }
                _ => messages.insert(0, ChatMessage::new("system", tools.clone())),
            }
        }
        let text = self
            .tokenizer
            .apply_chat_template(&messages, add_generation_prompt)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        // The template writes BOS itself where the model wants it.
        self.tokenize(&text, false)
    }

    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))
    }

    pub fn detokenize(&self, tokens: &[u32]) -> Result<String, ApiError> {
        self.tokenizer
            .decode(tokens, false)
            .map_err(|e| ApiError::invalid("tokens", e.to_string()))
    }

    fn completion_prompts(&self, prompt: &PromptInput) -> Result<Vec<Vec<u32>>, ApiError> {
        match prompt {
            PromptInput::Text(t) => Ok(vec![self.tokenize(t, true)?]),
            PromptInput::Texts(ts) => ts.iter().map(|t| self.tokenize(t, true)).collect(),
            PromptInput::Tokens(ids) => Ok(vec![ids.clone()]),
            PromptInput::TokenLists(lists) => Ok(lists.clone()),
        }
        .and_then(|v| match v.is_empty() {
            true => Err(ApiError::invalid("prompt", "prompt must not be empty")),
            false => Ok(v),
        })
    }

    /// Fixes `max_tokens` and checks the prompt fits.
    fn plan(
        &self,
        tokens: Vec<u32>,
        asked: Option<u32>,
        echo: Option<String>,
    ) -> Result<PromptPlan, ApiError> {
        if tokens.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt is empty"));
        }
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "token id {t} is outside the vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        let room = self.context_length.saturating_sub(tokens.len());
        let max_tokens =
            asked.unwrap_or_else(|| (self.limits.default_max_tokens as usize).min(room) as u32);
        if max_tokens == 0 || tokens.len() + max_tokens as usize > self.context_length {
            return Err(ApiError::ContextLength(format!(
                "this model's maximum context length is {} tokens; the request has {} prompt \
                 tokens and asks for {} completion tokens",
                self.context_length,
                tokens.len(),
                max_tokens.max(1)
            )));
        }
        Ok(PromptPlan {
            tokens,
            max_tokens,
            echo,
        })
    }
}

fn message_text(m: &RequestMessage) -> Result<ChatMessage, ApiError> {
    if !matches!(
        m.role.as_str(),
        "system" | "developer" | "user" | "assistant" | "tool"
    ) {
        return Err(ApiError::invalid(
            "messages",
            format!("unknown message role {:?}", m.role),
        ));
    }
    let content = match &m.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!("content parts of type {kind:?} are not supported"),
                        ))
                    }
                }
            }
            text
        }
    };
    // The templates know `system`; `developer` is OpenAI's newer name for it.
    let role = match m.role.as_str() {
        "developer" => "system",
        r => r,
    };
    // Calls and their results, as the model writes and reads them.
    let content = match (role, &m.tool_calls) {
        ("assistant", Some(calls)) if !calls.is_empty() => {
            let calls = structured::render_calls(calls);
            match content.is_empty() {
                true => calls,
                false => format!("{content}\n{calls}"),
            }
        }
        ("tool", _) => format!("<tool_response>\n{content}\n</tool_response>"),
        _ => content,
    };
    Ok(ChatMessage::new(role, content))
}
