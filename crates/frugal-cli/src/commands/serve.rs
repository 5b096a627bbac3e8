//! `frugal serve`: the OpenAI-compatible server (the `frugal-serve` crate) with the engine
//! flags of every other command.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use frugal::chat::ChatTemplate;
use frugal::kv::KvLayout;
use frugal_serve::{Loaded, ServeConfig};

use super::common::{self, EngineArgs, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on
    #[arg(long = "host", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed)
    #[arg(long = "port", default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together in one batch (continuous batching)
    #[arg(long = "parallel", default_value_t = 16)]
    pub parallel: usize,
    /// Requests that may wait for a slot; beyond that new requests get 429 with Retry-After
    #[arg(long = "max-queue", default_value_t = 128)]
    pub max_queue: usize,
    /// Longest sequence, prompt plus generation, in tokens [default: the model's trained
    /// context, or what the KV budget holds if that is less]
    #[arg(short = 'c', long = "ctx")]
    pub ctx: Option<usize>,
    /// Memory for the KV cache of all sequences together (B, KiB, MiB, GiB)
    #[arg(long = "kv-budget", default_value = "512MiB")]
    pub kv_budget: String,
    /// Tokens per forward pass: every running sequence's next token, then prompt chunks
    /// (chunked prefill) up to this budget
    #[arg(long = "batch-tokens", default_value_t = 256)]
    pub batch_tokens: usize,
    /// Do not reuse the keys and values of prompt prefixes seen before
    #[arg(long = "no-prefix-cache")]
    pub no_prefix_cache: bool,
    /// Model name clients use [default: the GGUF's general.basename, lowercased]
    #[arg(long = "alias")]
    pub alias: Option<String>,
    /// Speculative decoding by prompt lookup, ngram[:N][:K], or by prompt lookup then retrieval
    /// from a datastore (`frugal build-store`), store:FILE[:K], while at most 4 sequences decode
    /// (a larger batch is compute-bound: drafts would cost what they save); tokens are the
    /// same, greedy or not in distribution
    #[arg(long = "speculate", value_name = "ngram[:N][:K] | store:FILE[:K]")]
    pub speculate: Option<String>,
    /// Key clients must send as `Authorization: Bearer KEY`, else 401 (repeatable; without it,
    /// the environment variable FRUGAL_API_KEY); /health, /livez, /readyz and /metrics stay open
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Vec<String>,
    /// Origin browsers may call the API from, e.g. https://example.com, or * for any
    /// (repeatable; none: no CORS headers)
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Largest request body (B, KiB, MiB, GiB); a larger one gets 413
    #[arg(long = "max-body-bytes", value_name = "SIZE", default_value = "8MiB")]
    pub max_body_bytes: String,
    /// Seconds a request may take, streamed or not; then it gets 504 (a stream, an error event)
    /// and its generation stops (0: no limit)
    #[arg(long = "request-timeout", value_name = "SECS", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Seconds between keep-alive comments on an event stream that has nothing to send
    #[arg(long = "sse-keep-alive", value_name = "SECS", default_value_t = 15.0)]
    pub sse_keep_alive: f64,
    /// A Jinja chat template to use instead of the model file's (e.g. one that renders
    /// `tools` and `<tool_call>` turns)
    #[arg(long = "chat-template", value_name = "FILE")]
    pub chat_template: Option<std::path::PathBuf>,
    /// How /v1/embeddings pools the final hidden states of an input's tokens into one vector
    /// (L2-normalized): mean over every token, or the last token's
    #[arg(long = "pooling", value_name = "mean|last", default_value = "mean")]
    pub pooling: String,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// The environment variable `--api-key` falls back to.
const API_KEY_ENV: &str = "FRUGAL_API_KEY";

/// Seconds as a duration, for `flag`; `zero_is_none`: 0 turns the limit off.
fn seconds(flag: &str, s: f64, zero_is_none: bool) -> Result<Option<Duration>> {
    if zero_is_none && s == 0.0 {
        return Ok(None);
    }
    let d = Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} {s}: a positive number of seconds"))?;
    Ok(Some(d))
}

/// Parses sizes such as `512MiB`, `1GiB`, `300MB` or a plain byte count.
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a size (e.g. 512MiB)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => anyhow::bail!("unknown size unit {u:?} in {s:?} (B, KiB, MiB, GiB, KB, MB, GB)"),
    };
    let bytes = v * mult;
    anyhow::ensure!(
        bytes.is_finite() && bytes >= 1.0 && bytes < usize::MAX as f64,
        "{s:?} is not a usable size"
    );
    Ok(bytes as usize)
}

pub fn run(a: Args) -> Result<()> {
    // Every flag is checked before the model loads.
    let kv = a.engine.kv_options()?;
    let attention = a.engine.attention()?;
    let kv_block = match kv.layout {
        KvLayout::Paged { block_size } => block_size,
        KvLayout::Contiguous => {
            anyhow::bail!(
                "the server shares one paged KV pool among sequences: use --kv-layout paged"
            )
        }
    };
    anyhow::ensure!(a.parallel > 0, "--parallel must be at least 1");
    anyhow::ensure!(a.batch_tokens > 0, "--batch-tokens must be at least 1");
    if let Some(c) = a.ctx {
        anyhow::ensure!(c > 1, "--ctx must be at least 2");
    }
    use frugal::speculate::{DEFAULT_NGRAM, Method, SpecOptions, store::Datastore};
    let (speculate, store) = match &a.speculate {
        None => (None, None),
        Some(spec) => match spec.parse::<SpecOptions>() {
            Ok(SpecOptions {
                method: Method::Ngram { n },
                k,
                ..
            }) => (Some((n, k)), None),
            Ok(SpecOptions {
                method: Method::Store { path },
                k,
                ..
            }) => {
                let store = Datastore::read(&path)
                    .with_context(|| format!("reading the datastore {}", path.display()))?;
                (Some((DEFAULT_NGRAM, k)), Some(std::sync::Arc::new(store)))
            }
            Ok(_) => anyhow::bail!(
                "the server drafts by prompt lookup and retrieval only: --speculate ngram[:N][:K] or store:FILE[:K] (model drafters need a cache per sequence)"
            ),
            Err(e) => anyhow::bail!(e),
        },
    };
    let cfg = ServeConfig {
        host: a.host.clone(),
        port: a.port,
        parallel: a.parallel,
        max_queue: a.max_queue,
        ctx: a.ctx,
        kv_budget: parse_bytes(&a.kv_budget)?,
        kv_format: kv.format,
        kv_block,
        batch_tokens: a.batch_tokens,
        prefix_cache: !a.no_prefix_cache,
        attention,
        threads: rayon::current_num_threads(),
        speculate,
        store,
        api_keys: frugal_serve::ApiKeys::new(if a.api_key.is_empty() {
            std::env::var(API_KEY_ENV)
                .ok()
                .filter(|k| !k.is_empty())
                .into_iter()
                .collect()
        } else {
            a.api_key.clone()
        })
        .context("--api-key")?,
        cors_origins: a.cors_origin.clone(),
        max_body_bytes: parse_bytes(&a.max_body_bytes).context("--max-body-bytes")?,
        request_timeout: seconds("--request-timeout", a.request_timeout, true)?,
        sse_keep_alive: seconds("--sse-keep-alive", a.sse_keep_alive, false)?
            .unwrap_or(Duration::from_secs(15)),
        pooling: a
            .pooling
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--pooling: {e}"))?,
    };
    let model_args = a.model.clone();
    let alias = a.alias.clone();
    let ctx = a.ctx;
    let template_source = match &a.chat_template {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .with_context(|| format!("reading the chat template {}", p.display()))?,
        ),
        None => None,
    };
    let load = move || -> Result<Loaded> {
        let path = common::model_path(&model_args)?;
        let (mut model, tokenizer) = common::load(&model_args)?;
        // Each sequence's context: Phi-3's RoPE factors follow it.
        model
            .config
            .set_context(ctx.unwrap_or(model.config.n_ctx_train));
        let template = ChatTemplate::from_gguf_with(&model.file, template_source)?;
        let basename = model
            .file
            .str_opt("general.basename")
            .ok()
            .flatten()
            .map(str::to_ascii_lowercase);
        let stem = Path::new(&path)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned());
        let names: Vec<String> = alias
            .into_iter()
            .chain(basename)
            .chain(stem)
            .chain(Some(path.display().to_string()))
            .collect();
        Ok(Loaded {
            names,
            root: path.display().to_string(),
            template,
            tokenizer,
            model,
        })
    };
    // HTTP work is light: two runtime threads; the compute pool belongs to the scheduler.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(frugal_serve::run(cfg, load))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("300MB").unwrap(), 300_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("-5MiB").is_err());
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn seconds_refuse_nonsense_and_zero_turns_a_limit_off() {
        use super::seconds;
        use std::time::Duration;
        assert_eq!(
            seconds("--x", 1.5, true).unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(seconds("--x", 0.0, true).unwrap(), None);
        assert!(seconds("--x", 0.0, false).is_err());
        assert!(seconds("--x", -1.0, true).is_err());
        assert!(seconds("--x", f64::NAN, true).is_err());
    }
}
