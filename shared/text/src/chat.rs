//! Chat templates, rendered with minijinja from `tokenizer.chat_template`.

use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TextError};

/// One chat message, as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; a template minijinja cannot parse is an error now, not at the first request.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TextError::ChatTemplate(format!("cannot compile the template: {e:#}")))?;
        Ok(Self {
            env,
            bos: bos_token.to_string(),
            eos: eos_token.to_string(),
        })
    }

    /// Renders the prompt for `messages`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TextError::ChatTemplate(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| TextError::ChatTemplate(format!("cannot render the messages: {e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nDefault<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_and_explicit_system_prompt() {
        let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap();
        let user = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            t.render(&user, true).unwrap(),
            "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let sys = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
        ];
        assert_eq!(
            t.render(&sys, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let src = "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ messages[0]['content'].strip() | upper }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi ")], true)
                .unwrap(),
            "HI"
        );
        let err = t
            .render(&[ChatMessage::new("tool", "x")], true)
            .unwrap_err();
        assert!(err.to_string().contains("no tools"), "{err}");
    }

    #[test]
    fn broken_templates_are_clear_errors() {
        let err = ChatTemplate::new("{% for %}", "", "").err().unwrap();
        assert!(matches!(err, TextError::ChatTemplate(_)));
        assert!(err.to_string().contains("cannot compile"), "{err}");
    }
}
