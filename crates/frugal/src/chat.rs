//! Chat prompts rendered with the model's own Jinja template (`tokenizer.chat_template`).

use minijinja::{Environment, context};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// ChatML, used when a model ships no template.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// The template stored in the GGUF file, or ChatML if there is none.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let source = f
            .str_opt("tokenizer.chat_template")?
            .unwrap_or(CHATML)
            .to_string();
        let token = |key: &str| -> String {
            f.u32_opt(key)
                .ok()
                .flatten()
                .and_then(|i| {
                    f.str_array("tokenizer.ggml.tokens")
                        .ok()?
                        .get(i as usize)
                        .map(|s| s.to_string())
                })
                .unwrap_or_default()
        };
        Self::new(
            source,
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        )
    }

    pub fn new(source: String, bos: String, eos: String) -> Result<Self> {
        let mut env = Environment::new();
        // Hugging Face templates are written for Python's Jinja: allow its string methods.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| Error::Template(e.to_string()))?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the
    /// assistant's reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| Error::Template(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_turns_and_the_generation_prompt() {
        let t = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
        let s = t.render(&[Message::new("user", "Hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'].strip() }}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "  x ")], false).unwrap(),
            "x"
        );
    }
}
