//! Structured output: a request's `response_format` and `tools` become one
//! grammar (llguidance's Lark dialect) for the worker that samples, plus
//! the tools' description for the prompt.
//!
//! Tool calls are written the way Hermes-style chat models (SmolLM2, Qwen)
//! were trained to write them:
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! The grammar fixes this layout exactly (the name first, compact JSON), so
//! the router can stream a call's arguments as they are generated
//! (`respond::tools`).

use pdserve_protocol::openai::{ChatCompletionRequest, Tool};
use pdserve_text::grammar::Grammars;
use serde_json::{json, Value};

use crate::error::ApiError;

/// Opens a call in the output.
pub const CALL_OPEN: &str = "<tool_call>\n";
/// Between the opening and the function name.
pub const NAME_PREFIX: &str = "{\"name\": \"";
/// Between the function name and the arguments object.
pub const ARGS_PREFIX: &str = "\", \"arguments\": ";
/// After the arguments object.
pub const CALL_CLOSE: &str = "}\n</tool_call>";

/// What a chat request asks of its output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Structured {
    /// The grammar the output must match; `None`: free text.
    pub grammar: Option<String>,
    /// The tools' description, for the system message.
    pub tools_prompt: Option<String>,
    /// Whether tool calls are parsed out of the output.
    pub parse_calls: bool,
}

/// `tool_choice`, parsed.
#[derive(Debug, Clone, PartialEq)]
enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// How JSON is laid out: compact separators with one space, no free
/// whitespace (a small model otherwise pads with newlines for ever).
fn json_style() -> Value {
    json!({"whitespace_flexible": false, "key_separator": ": ", "item_separator": ", "})
}

/// `%json {schema}` with the house layout unless the schema sets its own.
fn json_rule(schema: &Value) -> String {
    let mut schema = schema.clone();
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(json_style);
    }
    format!("%json {schema}")
}

/// A Lark string literal (JSON escaping is Lark's).
fn lit(s: &str) -> String {
    Value::from(s).to_string()
}

fn invalid(param: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::invalid(param, msg.into())
}

/// The grammar rule of `response_format`, if it constrains the output.
fn response_format(v: Option<&Value>) -> Result<Option<String>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |m: &str| invalid("response_format", m);
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json_rule(&json!({"type": "object"})))),
        Some("json_schema") => {
            let spec = v
                .get("json_schema")
                .ok_or_else(|| bad("response_format.json_schema is required"))?;
            let schema = spec.get("schema").cloned().unwrap_or(json!({}));
            if !schema.is_object() && !schema.is_boolean() {
                return Err(bad("response_format.json_schema.schema must be an object"));
            }
            Ok(Some(json_rule(&schema)))
        }
        _ => Err(bad(
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

fn tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<Choice, ApiError> {
    let bad = |m: String| invalid("tool_choice", m);
    let choice = match v.filter(|v| !v.is_null()) {
        None if tools.is_empty() => Choice::None,
        None => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => return Err(bad(format!("unknown tool_choice {other:?}"))),
        },
        Some(obj) => {
            let name = obj
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice must name a function".into()))?;
            Choice::Named(name.to_string())
        }
    };
    match &choice {
        Choice::Required | Choice::Named(_) if tools.is_empty() => {
            Err(bad("tool_choice needs tools".into()))
        }
        Choice::Named(n) if !tools.iter().any(|t| &t.function.name == n) => Err(bad(format!(
            "tool_choice names {n:?}, which is not in tools"
        ))),
        _ => Ok(choice),
    }
}

fn check_tools(tools: &[Tool]) -> Result<(), ApiError> {
    let bad = |m: String| invalid("tools", m);
    for t in tools {
        if t.kind != "function" {
            return Err(bad(format!("tools of type {:?} are not supported", t.kind)));
        }
        let name = &t.function.name;
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !ok {
            return Err(bad(format!(
                "function name {name:?} must be 1 to 64 letters, digits, _ or -"
            )));
        }
        if let Some(p) = &t.function.parameters {
            if !p.is_object() {
                return Err(bad(format!(
                    "the parameters of {name} must be a JSON schema object"
                )));
            }
        }
    }
    Ok(())
}

/// The rules of a tool call grammar: `calls` for the tools allowed.
fn call_rules(tools: &[&Tool], parallel: bool) -> String {
    let mut rules = match parallel {
        true => "calls: call (\"\\n\" call)*\n".to_string(),
        false => "calls: call\n".to_string(),
    };
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    rules += &format!("call: {}\n", alts.join(" | "));
    for (i, t) in tools.iter().enumerate() {
        let head = format!("{CALL_OPEN}{NAME_PREFIX}{}{ARGS_PREFIX}", t.function.name);
        let args = t
            .function
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object"}));
        rules += &format!(
            "call_{i}: {} {} {}\n",
            lit(&head),
            json_rule(&args),
            lit(CALL_CLOSE)
        );
    }
    rules
}

/// The system-message text that lists the tools and the call format.
fn tools_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "You are a function calling AI model. You may call one or more functions to assist \
         with the user query. The functions you can call are listed within <tools></tools> \
         XML tags:\n<tools>\n",
    );
    for t in tools {
        s += &json!({"type": "function", "function": t.function}).to_string();
        s.push('\n');
    }
    s += "</tools>\nFor each function call, return a JSON object with the function name and \
          arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": \
          <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    s
}

/// Text in `auto` mode: anything that does not open a tool call.
const FREE_TEXT: &str = "TEXT: /(.|\\n)*/ & ~/<tool_call>(.|\\n)*/\n";

/// Plans a chat request's structured output, and checks that its grammar
/// compiles (an invalid schema is the request's fault: 400).
pub fn plan(
    req: &ChatCompletionRequest,
    grammars: Option<&Grammars>,
) -> Result<Structured, ApiError> {
    let format = response_format(req.response_format.as_ref())?;
    let tools = req.tools.as_deref().unwrap_or_default();
    check_tools(tools)?;
    let choice = tool_choice(req.tool_choice.as_ref(), tools)?;
    // A named function is called once, as OpenAI's `tool_choice` forces it.
    let parallel = req.parallel_tool_calls.unwrap_or(true) && !matches!(choice, Choice::Named(_));
    let allowed: Vec<&Tool> = match &choice {
        Choice::None => Vec::new(),
        Choice::Named(n) => tools.iter().filter(|t| &t.function.name == n).collect(),
        Choice::Auto | Choice::Required => tools.iter().collect(),
    };
    let format_rule = format.clone();
    let grammar = match (&choice, format) {
        (Choice::None, None) => None,
        (Choice::None, Some(f)) => Some(format!("start: {f}\n")),
        (Choice::Auto, None) => Some(format!(
            "start: calls | TEXT\n{FREE_TEXT}{}",
            call_rules(&allowed, parallel)
        )),
        (Choice::Auto, Some(f)) => Some(format!(
            "start: calls | answer\nanswer: {f}\n{}",
            call_rules(&allowed, parallel)
        )),
        (Choice::Required | Choice::Named(_), _) => {
            Some(format!("start: calls\n{}", call_rules(&allowed, parallel)))
        }
    };
    if let Some(g) = &grammar {
        let grammars = grammars.ok_or_else(|| {
            invalid(
                "response_format",
                "constrained decoding is not available for this model",
            )
        })?;
        let compile = |g: &str, param| grammars.check(g).map_err(|e| invalid(param, e.to_string()));
        match format_rule {
            Some(_) if allowed.is_empty() => compile(g, "response_format")?,
            Some(f) => {
                compile(&format!("start: {f}\n"), "response_format")?;
                compile(g, "tools")?;
            }
            None => compile(g, "tools")?,
        }
    }
    Ok(Structured {
        grammar,
        tools_prompt: (!allowed.is_empty()).then(|| tools_prompt(tools)),
        parse_calls: !allowed.is_empty(),
    })
}

/// An earlier assistant turn's calls, written as the model writes them.
pub fn render_calls(calls: &[pdserve_protocol::openai::ToolCall]) -> String {
    calls
        .iter()
        .map(|c| {
            format!(
                "{CALL_OPEN}{NAME_PREFIX}{}{ARGS_PREFIX}{}{CALL_CLOSE}",
                c.function.name, c.function.arguments
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
