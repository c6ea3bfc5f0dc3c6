//! The public OpenAI-compatible API: request and response objects of
//! `/v1/chat/completions`, `/v1/completions`, `/v1/models`, and vLLM's
//! `/tokenize` and `/detokenize`.
//!
//! Requests deserialize leniently (unknown fields are ignored, every optional
//! field may be absent or `null`); range checks belong to the router.
//! Responses serialize to the exact shapes of the OpenAI API.

use serde::{Deserialize, Serialize};

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: bool,
}

/// The sampling and length parameters both endpoints share.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CommonParams {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<StopSpec>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub user: Option<String>,
    /// vLLM's extension: > 1 discourages tokens already in the prompt or output.
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string) → bias added to its logit, in [-100, 100].
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
}

/// A chat message's content: a string, or a list of parts of which only
/// `{"type": "text"}` parts are understood.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// The calls an earlier assistant turn made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// On a `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A function the model may call (`tools[].function`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON schema of the arguments object; absent means any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// One entry of `tools`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

/// A call's function and its arguments (a JSON text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// One entry of `message.tool_calls`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// A streamed piece of a call: the first one carries id, type and name;
/// the next ones pieces of `arguments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCallDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<RequestMessage>,
    #[serde(flatten)]
    pub params: CommonParams,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`; checked by the router.
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    /// `"none" | "auto" | "required"` or `{"type": "function", "function": {"name": ...}}`.
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
}

/// A completions prompt: text, several texts, token ids, or several lists of ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptInput,
    #[serde(flatten)]
    pub params: CommonParams,
    /// Alternatives to report per token (0..=20).
    #[serde(default)]
    pub logprobs: Option<i64>,
    /// Prepend the prompt to the generated text.
    #[serde(default)]
    pub echo: Option<bool>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// How much of the prompt was served from the prefix cache.
    #[serde(default)]
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens found in a worker's prefix cache, not computed again.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// The same counts, with `cached` of the prompt tokens found cached.
    pub fn with_cached(self, cached: u32) -> Self {
        Self {
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached,
            },
            ..self
        }
    }
}

/// One alternative in chat `top_logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One generated token in chat `logprobs.content`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat `logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResponseMessage {
    pub role: String,
    /// `null` when the turn is only tool calls.
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ResponseMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

/// A non-streaming chat response (`object: "chat.completion"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

/// One SSE event of a streaming chat response (`object: "chat.completion.chunk"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Present (as `null` until the last chunk) when usage was asked for.
    #[serde(default, skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// A chunk's `usage`: left out, `null`, or the totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(from = "Option<Usage>")]
pub enum UsageField {
    #[default]
    Absent,
    Null,
    Some(Usage),
}

impl UsageField {
    pub fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }
}

impl From<Option<Usage>> for UsageField {
    fn from(u: Option<Usage>) -> Self {
        u.map_or(UsageField::Null, UsageField::Some)
    }
}

impl Serialize for UsageField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Some(u) => u.serialize(s),
            _ => s.serialize_none(),
        }
    }
}

/// Completions `logprobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    /// `null` for the first token of an echoed prompt (nothing precedes it).
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    pub text_offset: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// A completions response, and each SSE event of a streaming one
/// (`object: "text_completion"` in both).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "UsageField::is_absent")]
    pub usage: UsageField,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// `POST /tokenize`: a prompt, or chat messages rendered with the template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenizeRequest {
    Prompt {
        #[serde(default)]
        model: Option<String>,
        prompt: String,
        #[serde(default)]
        add_special_tokens: Option<bool>,
    },
    Chat {
        #[serde(default)]
        model: Option<String>,
        messages: Vec<RequestMessage>,
        #[serde(default)]
        add_special_tokens: Option<bool>,
        #[serde(default)]
        add_generation_prompt: Option<bool>,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: u32,
    pub max_model_len: u32,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// The OpenAI error body: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_requests_accept_unknown_fields_and_content_parts() {
        let r: ChatCompletionRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
                "max_tokens":5,"stop":"x","whatever":{"a":1},"logprobs":true,"top_logprobs":2}"#,
        )
        .unwrap();
        assert_eq!(r.params.max_tokens, Some(5));
        assert_eq!(r.params.stop, Some(StopSpec::One("x".into())));
        assert_eq!(r.top_logprobs, Some(2));
        assert!(matches!(
            r.messages[0].content,
            Some(MessageContent::Parts(_))
        ));
    }

    #[test]
    fn completion_prompts_take_every_shape() {
        for (json, want) in [
            (r#""a""#, PromptInput::Text("a".into())),
            (
                r#"["a","b"]"#,
                PromptInput::Texts(vec!["a".into(), "b".into()]),
            ),
            (r#"[1,2]"#, PromptInput::Tokens(vec![1, 2])),
            (
                r#"[[1],[2]]"#,
                PromptInput::TokenLists(vec![vec![1], vec![2]]),
            ),
        ] {
            let body = format!(r#"{{"model":"m","prompt":{json}}}"#);
            let r: CompletionRequest = serde_json::from_str(&body).unwrap();
            assert_eq!(r.prompt, want);
        }
    }

    #[test]
    fn chunk_usage_is_absent_null_or_present() {
        let mut c = ChatCompletionChunk {
            id: "x".into(),
            object: "chat.completion.chunk".into(),
            created: 1,
            model: "m".into(),
            system_fingerprint: "fp".into(),
            choices: vec![],
            usage: UsageField::Absent,
        };
        assert!(!serde_json::to_string(&c).unwrap().contains("usage"));
        c.usage = UsageField::Null;
        assert!(serde_json::to_string(&c)
            .unwrap()
            .contains(r#""usage":null"#));
        c.usage = UsageField::Some(Usage::new(3, 4));
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains(r#""total_tokens":7"#), "{json}");
    }

    #[test]
    fn tokenize_requests_are_prompt_or_messages() {
        let p: TokenizeRequest = serde_json::from_str(r#"{"prompt":"hi"}"#).unwrap();
        assert!(matches!(p, TokenizeRequest::Prompt { .. }));
        let c: TokenizeRequest =
            serde_json::from_str(r#"{"messages":[{"role":"user","content":"hi"}]}"#).unwrap();
        assert!(matches!(c, TokenizeRequest::Chat { .. }));
    }
}
