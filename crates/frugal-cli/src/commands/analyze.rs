//! `frugal analyze`: measurements of a model's numbers (the outlier problem).

use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::analyze::{self, SCHEMES, SiteReport, TensorAnalysis};
use frugal::gguf::GgufFile;
use frugal::model::Site;

use super::common::{self, ModelArgs};

#[derive(clap::Subcommand, Debug)]
pub enum AnalyzeCommand {
    /// Per weight tensor: absmax/RMS, kurtosis, and the quantization SNR of INT8 and INT4 under
    /// per-tensor, per-channel and per-block scales and of FP8 E4M3 vs E5M2. With --text, also
    /// the activation channels that dominate on that text.
    Quant(QuantArgs),
}

#[derive(clap::Args, Debug)]
pub struct QuantArgs {
    /// The GGUF model or a known model's name [default: --model, else the default model]
    #[arg(value_parser = common::model_arg)]
    pub path: Option<PathBuf>,
    /// Record activations on this text and report the dominant channels
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Tokens of the text to run (from its start)
    #[arg(long = "tokens", default_value_t = 512)]
    pub tokens: usize,
    /// Rows of the weight table to print, most heavy-tailed first (0 = all)
    #[arg(long = "top", default_value_t = 0)]
    pub top: usize,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(c: AnalyzeCommand) -> Result<()> {
    match c {
        AnalyzeCommand::Quant(a) => quant(a),
    }
}

fn site_name(s: Site) -> &'static str {
    match s {
        Site::AttnInput => "attn_input",
        Site::AttnOutput => "attn_output",
        Site::FfnInput => "ffn_input",
        Site::FfnDownInput => "ffn_down_input",
        Site::LayerOutput => "layer_output",
    }
}

fn quant(mut a: QuantArgs) -> Result<()> {
    anyhow::ensure!(
        a.path.is_none() || a.model.model.is_none(),
        "give the model either as an argument or with --model, not both"
    );
    if let Some(p) = a.path.take() {
        a.model.model = Some(p);
    }
    let path = common::model_path(&a.model)?;
    let file = GgufFile::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let t0 = std::time::Instant::now();
    let mut tensors = analyze::analyze_weights(&file, |_, _| {})?;
    let weight_secs = t0.elapsed().as_secs_f64();
    drop(file);

    let activations = match &a.text {
        None => None,
        Some(text) => {
            let bytes =
                std::fs::read(text).with_context(|| format!("reading {}", text.display()))?;
            let text_s = String::from_utf8(bytes)
                .map_err(|_| anyhow::anyhow!("{} is not valid UTF-8", text.display()))?;
            let (model, tok) = common::load(&a.model)?;
            let mut ids = tok.encode(&text_s, false)?;
            anyhow::ensure!(!ids.is_empty(), "{} has no tokens", text.display());
            ids.truncate(a.tokens.max(1));
            let ctx = ids.len().min(model.config.n_ctx_train);
            Some(analyze::record_activations(&model, &ids, ctx)?)
        }
    };

    if a.json {
        let mut v = serde_json::json!({
            "model": path.display().to_string(),
            "schemes": SCHEMES,
            "tensors": tensors,
            "seconds": weight_secs,
        });
        if let Some(sites) = &activations {
            v["activations"] = serde_json::to_value(sites)?;
            v["dominant_factor"] = analyze::DOMINANT_FACTOR.into();
            v["recurring_channels"] = analyze::recurring_channels(sites)
                .into_iter()
                .map(|(s, c, n)| serde_json::json!({"site": s, "channel": c, "layers": n}))
                .collect();
        }
        println!("{v}");
        return Ok(());
    }
    print_weights(&mut tensors, a.top, weight_secs);
    if let Some(sites) = &activations {
        print_activations(sites);
    }
    Ok(())
}

fn fmt_db(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:5.1}"),
        Some(_) => "  inf".to_string(),
        None => "    -".to_string(),
    }
}

fn print_weights(tensors: &mut [TensorAnalysis], top: usize, secs: f64) {
    println!(
        "{} weight matrices, analyzed in {secs:.1} s. Quantization SNR in dB (higher is better; +6 dB ~ one more bit).",
        tensors.len()
    );
    println!(
        "Columns: T = one scale per tensor, C = per output channel, B32 = per block of 32 weights; kurtosis is 3 for a Gaussian."
    );
    // Most heavy-tailed first: those are where the schemes disagree.
    tensors.sort_by(|x, y| {
        y.moments
            .absmax_over_rms
            .total_cmp(&x.moments.absmax_over_rms)
    });
    println!(
        "{:<28} {:<5} {:>9} {:>8} | {:>5} {:>5} {:>5} | {:>5} {:>5} {:>5} | {:>5} {:>5} | {:>5} {:>5}",
        "tensor",
        "type",
        "absmax/σ",
        "kurt",
        "i8 T",
        "i8 C",
        "i8 B",
        "i4 T",
        "i4 C",
        "i4 B",
        "e4 T",
        "e4 B",
        "e5 T",
        "e5 B"
    );
    let n = if top == 0 {
        tensors.len()
    } else {
        top.min(tensors.len())
    };
    for t in &tensors[..n] {
        let s = |k: &str| fmt_db(t.snr(k));
        println!(
            "{:<28} {:<5} {:>9.1} {:>8.1} | {} {} {} | {} {} {} | {} {} | {} {}",
            t.name,
            t.stored_type,
            t.moments.absmax_over_rms,
            t.moments.kurtosis,
            s("int8-tensor"),
            s("int8-channel"),
            s("int8-b32"),
            s("int4-tensor"),
            s("int4-channel"),
            s("int4-b32"),
            s("fp8-e4m3-tensor"),
            s("fp8-e4m3-b32"),
            s("fp8-e5m2-tensor"),
            s("fp8-e5m2-b32"),
        );
    }
    if n < tensors.len() {
        println!("... {} more (--top 0 shows all)", tensors.len() - n);
    }
    // The median over tensors per scheme: the overall ranking.
    println!("median SNR over all matrices:");
    for scheme in SCHEMES {
        let mut v: Vec<f64> = tensors.iter().filter_map(|t| t.snr(scheme)).collect();
        v.sort_by(f64::total_cmp);
        if let Some(m) = v.get(v.len() / 2) {
            let worst = v.first().copied();
            println!(
                "  {scheme:<16} {} dB (worst tensor {} dB)",
                fmt_db(Some(*m)),
                fmt_db(worst)
            );
        }
    }
}

fn print_activations(sites: &[SiteReport]) {
    let tokens = sites.first().map(|s| s.tokens).unwrap_or(0);
    println!();
    println!(
        "Activations on {tokens} tokens: inputs of each matrix product. A channel dominates when its largest magnitude is >= {}x the median channel's.",
        analyze::DOMINANT_FACTOR
    );
    let mut sorted: Vec<&SiteReport> = sites.iter().collect();
    sorted.sort_by(|a, b| b.absmax_over_rms.total_cmp(&a.absmax_over_rms));
    println!(
        "{:>5} {:<15} {:>8} {:>9} {:>6} {:>9} {:>9}  dominant channels (absmax, x median)",
        "layer", "site", "absmax", "absmax/σ", "n_dom", "i8 token", "i8 B32"
    );
    for s in sorted.iter().take(20) {
        let dom: Vec<String> = s
            .dominant
            .iter()
            .take(4)
            .map(|c| format!("{} ({:.1}, {:.0}x)", c.channel, c.absmax, c.over_median))
            .collect();
        println!(
            "{:>5} {:<15} {:>8.2} {:>9.1} {:>6} {} {}  {}",
            s.layer,
            site_name(s.site),
            s.absmax,
            s.absmax_over_rms,
            s.n_dominant,
            format_args!("{:>9}", fmt_db(Some(s.int8_per_token_snr_db))),
            format_args!("{:>9}", fmt_db(Some(s.int8_per_block32_snr_db))),
            dom.join(", ")
        );
    }
    if sorted.len() > 20 {
        println!("... {} more sites (--json has all)", sorted.len() - 20);
    }
    let recurring = analyze::recurring_channels(sites);
    let layers = sites.iter().map(|s| s.layer).max().map_or(0, |l| l + 1);
    let shown: Vec<String> = recurring
        .iter()
        .filter(|r| r.2 > 1)
        .take(8)
        .map(|(s, c, n)| format!("{} ch {c} in {n}/{layers} layers", site_name(*s)))
        .collect();
    if !shown.is_empty() {
        println!("recurring dominant channels: {}", shown.join("; "));
    }
}
