//! `frugal estimate`: KV-cache and memory arithmetic for a model at a context length, and the
//! long-context serving table (text, JSON, and an SVG or PNG chart).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use frugal::estimate::{
    self, AttentionVariant, Catalog, Device, Estimate, Format, KvShape, ModelDesc, Options,
    binary_units, grouped, human_bytes, short_context, short_count,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A catalog name (see --list; a unique prefix is enough), a GGUF file, or a Hugging Face
    /// config.json (or the folder holding it)
    #[arg(required_unless_present = "list")]
    pub model: Option<String>,
    /// List the models of the built-in catalog
    #[arg(long)]
    pub list: bool,
    /// Tokens per sequence: 4096, 32k, 128k, 1m (k = 1024) [default: the model's maximum]
    #[arg(short = 'c', long)]
    pub context: Option<String>,
    /// Sequences held at once
    #[arg(short = 'b', long, default_value_t = 1)]
    pub batch: u64,
    /// KV-cache element type: f32, f16, bf16, fp8, q8_0 (8.5 bits), q4_0 (4.5 bits)
    #[arg(long = "kv-type", default_value = "f16")]
    pub kv_type: String,
    /// Weight format for the comparisons: f32, bf16, fp8, q8_0, q4_k, q4_0, mxfp4
    /// [default: bf16, or the stored size of a GGUF file]
    #[arg(long)]
    pub weights: Option<String>,
    /// Compare with the attention converted, comma-separated: mha, gqa:G, mqa, mla:R
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<String>,
    /// Serving device presets, comma-separated: h100-80gb, h200, a100-40gb, a100-80gb, l4,
    /// l40s, rtx-4090, rtx-3090, mi300x
    #[arg(long, value_delimiter = ',')]
    pub device: Vec<String>,
    /// Serving device memory with its unit, comma-separated: 80GiB (2^30 B) or 80GB (10^9 B)
    #[arg(long = "device-memory", value_delimiter = ',')]
    pub device_memory: Vec<String>,
    /// Devices pooled to hold one replica of the model (tensor parallel)
    #[arg(long = "devices-per-replica", default_value_t = 1)]
    pub devices_per_replica: u64,
    /// Write the long-context chart to PATH (.svg or .png)
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print one JSON object with every number instead of text
    #[arg(long)]
    pub json: bool,
}

const UNITS: &str = "Units: B = byte; KiB, MiB, GiB = 2^10, 2^20, 2^30 B; KB, MB, GB = 10^3, 10^6, 10^9 B; \
                     k in a context length = 1024 tokens.";

pub fn run(a: Args) -> Result<()> {
    if a.list {
        return list(a.json);
    }
    let spec = a
        .model
        .as_deref()
        .ok_or_else(|| anyhow!("give a model name, a GGUF file or a config.json (or --list)"))?;
    // A model frugal fetches by name (`gemma3-270m`) is estimated from its GGUF file.
    let resolved = frugal::fetch::resolve_model_arg(Path::new(spec));
    let spec = if resolved != Path::new(spec) {
        super::common::input_model(Some(&resolved))?
            .display()
            .to_string()
    } else {
        spec.to_string()
    };
    let desc = estimate::desc::resolve(&spec)?;
    let mut devices = Vec::new();
    for d in &a.device {
        devices.push(Device::preset(d)?);
    }
    for m in &a.device_memory {
        devices.push(Device::custom(estimate::parse_size(m)?, m.trim()));
    }
    let opts = Options {
        context: a
            .context
            .as_deref()
            .map(estimate::parse_context)
            .transpose()?,
        batch: a.batch,
        kv_type: Format::parse(&a.kv_type, Format::KV, "KV type")?,
        weights: a
            .weights
            .as_deref()
            .map(|w| Format::parse(w, Format::WEIGHTS, "weight format"))
            .transpose()?,
        compare: a
            .compare
            .iter()
            .map(|v| AttentionVariant::parse(v, &desc))
            .collect::<std::result::Result<_, _>>()?,
        devices,
        devices_per_replica: a.devices_per_replica,
    };
    let est = estimate::estimate(&desc, &opts)?;
    if let Some(p) = &a.plot {
        plot::write(&est, p).with_context(|| format!("writing the chart {}", p.display()))?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&est)?);
    } else {
        print_text(&est);
        if let Some(p) = &a.plot {
            println!("\nchart written to {}", p.display());
        }
    }
    Ok(())
}

fn list(json: bool) -> Result<()> {
    let cat = Catalog::builtin()?;
    let mut rows = Vec::new();
    for e in &cat.models {
        let d = cat.to_desc(e)?;
        let kv = KvShape::of_model(&d).bytes_per_token(&d, Format::F16);
        rows.push((d, kv));
    }
    if json {
        let v: Vec<_> = rows
            .iter()
            .map(|(d, kv)| {
                serde_json::json!({
                    "id": d.id, "name": d.name, "attention": d.attention_label(),
                    "params_total_published": d.params_total_published,
                    "params_active_published": d.params_active_published,
                    "max_context": d.max_context, "kv_bytes_per_token_f16": kv,
                    "hf_repo": d.hf_repo, "source": d.source,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let idw = rows.iter().map(|(d, _)| d.id.len()).max().unwrap_or(2);
    println!(
        "{:<idw$}  {:>8} {:>7} {:>8} {:>11}  attention",
        "id", "params", "active", "context", "KV/token"
    );
    for (d, kv) in &rows {
        let window = d
            .sliding_window
            .as_ref()
            .map(|w| format!("; window {} on {}", w.window, w.pattern))
            .unwrap_or_default();
        println!(
            "{:<idw$}  {:>8} {:>7} {:>8} {:>11}  {}{window}",
            d.id,
            d.params_total_published
                .map(short_count)
                .unwrap_or_default(),
            d.params_active_published
                .map(short_count)
                .unwrap_or_default(),
            d.max_context.map(short_context).unwrap_or_default(),
            binary_units(*kv),
            d.attention_label(),
        );
    }
    println!(
        "\n{} models; params and active as published; KV/token in f16. Names match case-insensitively and a unique prefix is enough. Sources: `--list --json`.",
        rows.len()
    );
    Ok(())
}

/// `1,234 B (1.21 KiB, 1.23 KB)`.
fn bytes(b: u64) -> String {
    if b < 1000 {
        format!("{b} B")
    } else {
        format!("{} B ({})", grouped(b as u128), human_bytes(b as u128))
    }
}

fn pct(r: f64) -> String {
    format!("{:+.1}%", r * 100.0)
}

fn print_text(e: &Estimate) {
    let d = &e.model;
    print_model(d);
    println!("{UNITS}");

    // KV cache.
    println!(
        "\nKV cache: {} ({} bits per element), {} tokens x batch {}",
        e.kv_type,
        e.kv_bits_per_element,
        grouped(e.context as u128),
        e.batch
    );
    println!("  attention     {}", e.attention);
    println!("  per token     {}", e.kv_formula);
    println!("                = {}", bytes(e.kv_bytes_per_token));
    if e.kv_window_layers > 0 {
        let (w, cached) = d
            .sliding_window
            .as_ref()
            .map_or((0, 0), |w| (w.window, w.cached));
        println!(
            "  per sequence  sliding window of {} positions on {}: those layers hold min({}, {}) = {} positions{}",
            grouped(w as u128),
            d.sliding_window.as_ref().map_or("", |w| w.pattern.as_str()),
            grouped(e.context as u128),
            grouped(cached as u128),
            grouped(e.kv_window_positions as u128),
            if cached != w {
                " (frugal's ring: see the note below)"
            } else {
                ""
            }
        );
        println!(
            "                = {} elements x {} B per layer and position x ({} full layers x {} + {} windowed layers x {})",
            grouped(e.kv_elements_per_token_per_layer as u128),
            estimate::kv::bytes_per_element_text(e.kv_type),
            e.kv_full_layers,
            grouped(e.context as u128),
            e.kv_window_layers,
            grouped(e.kv_window_positions as u128)
        );
        let unwindowed = e.kv_bytes_per_token as u128 * e.context as u128;
        println!(
            "                = {}   (without the window: {})",
            bytes(e.kv_cache_bytes_per_sequence),
            binary_units(unwindowed)
        );
    } else {
        println!(
            "  per sequence  {} B x {} tokens",
            grouped(e.kv_bytes_per_token as u128),
            grouped(e.context as u128)
        );
        println!("                = {}", bytes(e.kv_cache_bytes_per_sequence));
    }
    println!(
        "  batch of {:<4} {} B x {} = {}",
        e.batch,
        grouped(e.kv_cache_bytes_per_sequence as u128),
        e.batch,
        bytes(e.kv_cache_bytes)
    );

    print_params(e);

    // Weights.
    println!("\nWeights (every tensor in one format; quantized files keep some tensors wider)");
    println!("  {:<7} {:>11}  bytes", "format", "bits/weight");
    for w in &e.weights_by_format {
        println!(
            "  {:<7} {:>11}  {}",
            w.format.name(),
            w.bits_per_weight,
            bytes(w.bytes)
        );
    }
    if let Some(fp) = &d.file_params {
        let types: Vec<String> = fp
            .by_type
            .iter()
            .map(|(t, n, b)| format!("{n} {t} ({})", binary_units(*b as u128)))
            .collect();
        println!(
            "  {:<7} {:>11.2}  {}   as stored in this file: {}",
            "stored",
            fp.bytes as f64 * 8.0 / fp.total.max(1) as f64,
            bytes(fp.bytes),
            types.join(", ")
        );
    }

    // Side by side.
    let wlabel = if e.weights_format == "stored" {
        "the file's stored".to_string()
    } else {
        e.weights_format.clone()
    };
    println!(
        "\nKV cache vs weights ({wlabel} weights = {})",
        bytes(e.weights_bytes)
    );
    println!(
        "  {} tokens x {} sequence(s): the cache is {:.3}x the weights",
        grouped(e.context as u128),
        e.batch,
        e.kv_to_weights_ratio
    );
    let max = d.max_context.unwrap_or(e.context);
    let describe = |c: Option<u64>, who: &str| match c {
        Some(c) => {
            let past = if c > max {
                format!(
                    " (past the model's maximum context of {})",
                    grouped(max as u128)
                )
            } else {
                String::new()
            };
            println!(
                "  {who} outgrows the weights at {} tokens{past}",
                grouped(c as u128)
            );
        }
        None => println!(
            "  {who} never outgrows the weights: every layer is windowed, so the cache stops growing"
        ),
    };
    describe(e.crossover_context_one_sequence, "one sequence's cache");
    if e.batch > 1 {
        describe(
            e.crossover_context_batch,
            &format!("the cache of {} sequences", e.batch),
        );
    }

    if !e.compare.is_empty() {
        println!(
            "\nAttention converted: cache at {} tokens x {}",
            grouped(e.context as u128),
            e.batch
        );
        println!(
            "  {:<12} {:<54} {:>12} {:>12} {:>12} {:>8}",
            "variant", "attention", "elem/tok/lyr", "per token", "cache", "ratio"
        );
        println!(
            "  {:<12} {:<54} {:>12} {:>12} {:>12} {:>8}",
            "(this model)",
            e.attention,
            grouped(e.kv_elements_per_token_per_layer as u128),
            binary_units(e.kv_bytes_per_token as u128),
            binary_units(e.kv_cache_bytes as u128),
            "1.000x"
        );
        for c in &e.compare {
            println!(
                "  {:<12} {:<54} {:>12} {:>12} {:>12} {:>7.3}x",
                c.variant,
                c.label,
                grouped(c.kv_elements_per_token_per_layer as u128),
                binary_units(c.kv_bytes_per_token as u128),
                binary_units(c.kv_cache_bytes as u128),
                c.ratio
            );
        }
        if let Some(n) = &e.compare_note {
            println!("  {n}");
        }
    }

    print_serving(e);

    for r in &e.remarks {
        println!("\nNote: {r}");
    }
    if !d.notes.is_empty() {
        println!("\nNotes:");
        for n in &d.notes {
            println!("  - {n}");
        }
    }
    if !d.warnings.is_empty() {
        println!("\nWarnings (fields not understood, unverified or assumed):");
        for w in &d.warnings {
            println!("  - {w}");
        }
    }
}

fn print_model(d: &ModelDesc) {
    let from = match d.origin {
        estimate::Origin::Catalog => "from the catalog".to_string(),
        _ => format!("from {}", d.origin.label()),
    };
    println!("{} ({}), {from}", d.name, d.id);
    println!("  source: {}", d.source);
    if let Some(r) = &d.hf_repo {
        println!("  Hugging Face repo: {r}");
    }
    let mut shape = format!(
        "  {} layers, hidden {}, {}, head_dim {}, ",
        d.n_layers,
        d.hidden,
        d.attention_label(),
        d.head_dim
    );
    if d.ff > 0 {
        shape += &format!("FFN {}, ", d.ff);
    }
    shape += &format!("vocab {}", d.vocab);
    println!("{shape}");
    let ctx = match (d.max_context, d.published_context) {
        (Some(m), Some(p)) if p != m => format!(
            "maximum context {} (published: {})",
            grouped(m as u128),
            grouped(p as u128)
        ),
        (Some(m), _) => format!("maximum context {}", grouped(m as u128)),
        (None, _) => "maximum context unknown".to_string(),
    };
    println!("  {ctx}");
}

fn print_params(e: &Estimate) {
    let d = &e.model;
    let p = &e.params;
    println!("\nParameters (computed from the configuration)");
    let published = |c: &Option<estimate::report::PublishedCheck>| match c {
        Some(c) => format!(
            "   published {}: {}",
            short_count(c.published),
            pct(c.rel_diff)
        ),
        None => String::new(),
    };
    println!(
        "  total         {} ({}){}",
        grouped(p.total as u128),
        short_count(p.total as f64),
        published(&e.params_total_published)
    );
    if let Some(m) = &d.moe {
        println!(
            "  active/token  {} ({}){}   ({} counting the input embedding table)",
            grouped(p.active as u128),
            short_count(p.active as f64),
            published(&e.params_active_published),
            short_count(p.active_with_embedding as f64)
        );
        let shared = if m.shared_ff > 0 {
            format!(" + {} shared (width {})", m.shared_experts, m.shared_ff)
        } else {
            String::new()
        };
        let dense = d.n_layers - m.moe_layers;
        let dense_text = if dense > 0 {
            format!("; {dense} dense layer(s) of FFN width {}", d.ff)
        } else {
            String::new()
        };
        println!(
            "  experts       {} routed ({} per token, width {}){shared} in {} of {} layers{dense_text}",
            m.experts, m.experts_per_token, m.expert_ff, m.moe_layers, d.n_layers
        );
    }
    if let Some(n) = &d.params_published_note {
        println!("  published figures: {n}");
    }
    let mut parts = vec![format!("attention {}", short_count(p.attention as f64))];
    for (name, v) in [
        ("dense FFN", p.dense_ffn),
        ("routed experts", p.routed_experts),
        ("of which used per token", p.routed_experts_active),
        ("shared experts", p.shared_experts),
        ("routers", p.routers),
        ("norms", p.norms),
        ("embedding", p.embedding),
        ("output head", p.output_head),
    ] {
        if v > 0 {
            parts.push(format!("{name} {}", short_count(v as f64)));
        }
    }
    if d.tie_embeddings {
        parts.push("output head tied to the embedding".into());
    }
    println!("  by part: {}", parts.join(", "));
    if let Some(fp) = &d.file_params {
        println!(
            "  counted from the file's tensors: {} total, {} active; the arithmetic above is {}",
            grouped(fp.total as u128),
            grouped(fp.active as u128),
            pct(p.total as f64 / fp.total.max(1) as f64 - 1.0)
        );
    }
}

fn print_serving(e: &Estimate) {
    let s = &e.serving;
    println!(
        "\nLong context: {} KV cache, {} weights {}",
        s.kv_type,
        if e.weights_format == "stored" {
            "stored".to_string()
        } else {
            e.weights_format.clone()
        },
        binary_units(s.weights_bytes as u128)
    );
    for (d, free) in s.devices.iter().zip(&s.free_bytes) {
        let pooled = if s.devices_per_replica > 1 {
            format!(" x {} per replica", s.devices_per_replica)
        } else {
            String::new()
        };
        if *free == 0 {
            println!(
                "  {}: {}{pooled} ({}): the weights do not fit; try --weights q4_k, more --devices-per-replica, or a larger device",
                d.name,
                binary_units(d.memory_bytes as u128),
                d.note
            );
        } else {
            println!(
                "  {}: {}{pooled} ({}), {} left for KV caches",
                d.name,
                binary_units(d.memory_bytes as u128),
                d.note,
                binary_units(*free as u128)
            );
        }
    }
    let mut head = format!("  {:>7} {:>11}", "context", "KV/seq");
    for d in &s.devices {
        head += &format!(" {:>12}", format!("seqs {}", d.name));
    }
    head += &format!(
        " {:>10} {:>10} {:>9} {:>6} {:>12} {:>12}",
        "KVxtime", "prefill", "FLOPs", "attn%", "KVxtime/tok", "FLOPs/tok"
    );
    println!("{head}");
    for r in &s.rows {
        let mut line = format!(
            "  {:>7} {:>11}",
            short_context(r.context),
            binary_units(r.kv_bytes_per_sequence as u128)
        );
        for n in &r.sequences {
            line += &format!(" {:>12}", grouped(*n as u128));
        }
        line += &format!(
            " {:>9.1}x {:>9.1}x {:>9.2e} {:>5.1}% {:>11.2}x {:>11.2}x",
            r.kv_memory_time_rel,
            r.prefill_flops_rel,
            r.prefill_flops,
            100.0 * r.prefill_attention_flops / r.prefill_flops.max(1.0),
            r.kv_memory_time_per_token_rel,
            r.prefill_flops_per_token_rel
        );
        println!("{line}");
    }
    println!(
        "  KVxtime: cache size x time held per request; prefill: its FLOPs; /tok: per token; all relative to the first row."
    );
    println!("  {}", s.caveat);
}

/// The long-context chart, drawn with plotters.
mod plot {
    use super::*;
    use plotters::coord::Shift;
    use plotters::prelude::*;

    pub fn write(e: &Estimate, path: &Path) -> Result<()> {
        let ext = path
            .extension()
            .and_then(|x| x.to_str())
            .map(str::to_ascii_lowercase);
        crate::commands::font::register_chart_font()?;
        let size = (1000u32, 760u32);
        match ext.as_deref() {
            Some("svg") => draw(SVGBackend::new(path, size).into_drawing_area(), e),
            Some("png") => draw(BitMapBackend::new(path, size).into_drawing_area(), e),
            _ => bail!("the chart's file name must end in .svg or .png"),
        }
    }

    fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
        anyhow!("drawing the chart: {e}")
    }

    const COLORS: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(23, 190, 207),
    ];

    fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, e: &Estimate) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE).map_err(err)?;
        let title = format!(
            "{}: long context, {} KV cache, {} weights",
            e.model.name, e.kv_type, e.weights_format
        );
        let root = root.titled(&title, ("sans-serif", 22)).map_err(err)?;
        let (top, bottom) = root.split_vertically(370);
        let rows = &e.serving.rows;
        let (x0, x1) = (
            rows.first().map_or(1.0, |r| r.context as f64),
            rows.last().map_or(2.0, |r| r.context as f64),
        );
        let (x0, x1) = if x1 > x0 {
            (x0, x1)
        } else {
            (x0 / 2.0, x0 * 2.0)
        };
        let xfmt = |v: &f64| short_context(v.round() as u64);
        // Ticks at the table's context lengths (powers of two), not at decimal round numbers.
        let xkeys: Vec<f64> = rows.iter().map(|r| r.context as f64).collect();
        let xaxis = || (x0..x1).log_scale().with_key_points(xkeys.clone());
        let count_fmt = |v: &f64| {
            if *v >= 1.0 {
                grouped(v.round() as u128)
            } else {
                format!("{v:.2}")
            }
        };
        let times_fmt = |v: &f64| {
            if *v >= 1.0 {
                format!("{}x", grouped(v.round() as u128))
            } else {
                format!("{v:.2}x")
            }
        };

        // Top: sequences that fit per device, or the cache per sequence when no device is given.
        if e.serving.devices.is_empty() {
            let ys: Vec<f64> = rows
                .iter()
                .map(|r| r.kv_bytes_per_sequence as f64 / (1u64 << 30) as f64)
                .collect();
            let (lo, hi) = bounds(&ys);
            let mut c = ChartBuilder::on(&top)
                .margin(12)
                .caption("KV cache per sequence (GiB, log scale)", ("sans-serif", 17))
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(xaxis(), (lo..hi).log_scale())
                .map_err(err)?;
            c.configure_mesh()
                .x_desc("context (tokens)")
                .y_desc("GiB")
                .x_label_formatter(&xfmt)
                .y_label_formatter(&|v: &f64| format!("{v:.2}"))
                .draw()
                .map_err(err)?;
            let pts: Vec<(f64, f64)> = rows.iter().map(|r| r.context as f64).zip(ys).collect();
            c.draw_series(LineSeries::new(pts.clone(), COLORS[0].stroke_width(2)))
                .map_err(err)?;
            c.draw_series(PointSeries::of_element(
                pts,
                4,
                COLORS[0].filled(),
                &|p, s, st| EmptyElement::at(p) + Circle::new((0, 0), s, st),
            ))
            .map_err(err)?;
        } else {
            let all: Vec<f64> = rows
                .iter()
                .flat_map(|r| r.sequences.iter().map(|&n| n as f64))
                .filter(|&n| n > 0.0)
                .collect();
            let (lo, hi) = if all.is_empty() {
                (0.5, 10.0)
            } else {
                bounds(&all)
            };
            let mut c = ChartBuilder::on(&top)
                .margin(12)
                .caption(
                    "Concurrent sequences that fit after the weights (log scale)",
                    ("sans-serif", 17),
                )
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(xaxis(), (lo..hi).log_scale())
                .map_err(err)?;
            c.configure_mesh()
                .x_desc("context (tokens)")
                .y_desc("sequences")
                .x_label_formatter(&xfmt)
                .y_label_formatter(&count_fmt)
                .draw()
                .map_err(err)?;
            let n = e.serving.devices.len() as u32;
            for (i, d) in e.serving.devices.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                // Earlier lines are wider, so devices of equal memory stay visible.
                let width = 2 + 3 * (n - 1 - i as u32).min(3);
                let pts: Vec<(f64, f64)> = rows
                    .iter()
                    .filter(|r| r.sequences[i] > 0)
                    .map(|r| (r.context as f64, r.sequences[i] as f64))
                    .collect();
                c.draw_series(LineSeries::new(pts.clone(), color.stroke_width(width)))
                    .map_err(err)?
                    .label(if pts.is_empty() {
                        format!("{} (weights do not fit)", d.name)
                    } else {
                        d.name.clone()
                    })
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
                c.draw_series(PointSeries::of_element(
                    pts,
                    4,
                    color.filled(),
                    &|p, s, st| EmptyElement::at(p) + Circle::new((0, 0), s, st),
                ))
                .map_err(err)?;
            }
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()
                .map_err(err)?;
        }

        // Bottom: relative cost per request and per token.
        let series: [(&str, Vec<f64>); 4] = [
            (
                "KV memory x time per request",
                rows.iter().map(|r| r.kv_memory_time_rel).collect(),
            ),
            (
                "prefill FLOPs per request",
                rows.iter().map(|r| r.prefill_flops_rel).collect(),
            ),
            (
                "KV memory x time per token",
                rows.iter()
                    .map(|r| r.kv_memory_time_per_token_rel)
                    .collect(),
            ),
            (
                "prefill FLOPs per token",
                rows.iter().map(|r| r.prefill_flops_per_token_rel).collect(),
            ),
        ];
        let all: Vec<f64> = series.iter().flat_map(|s| s.1.iter().copied()).collect();
        let (lo, hi) = bounds(&all);
        let mut c = ChartBuilder::on(&bottom)
            .margin(12)
            .caption(
                format!(
                    "Cost relative to a {}-token request (log scale)",
                    short_context(rows.first().map_or(0, |r| r.context))
                ),
                ("sans-serif", 17),
            )
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(xaxis(), (lo..hi).log_scale())
            .map_err(err)?;
        c.configure_mesh()
            .x_desc("context (tokens)")
            .y_desc("relative to the first context")
            .x_label_formatter(&xfmt)
            .y_label_formatter(&times_fmt)
            .draw()
            .map_err(err)?;
        for (i, (name, ys)) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = rows
                .iter()
                .map(|r| r.context as f64)
                .zip(ys.iter().copied())
                .collect();
            let style = if i < 2 {
                color.stroke_width(2)
            } else {
                color.stroke_width(1)
            };
            c.draw_series(LineSeries::new(pts, style))
                .map_err(err)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }

    /// Log-axis bounds around positive values, padded so points do not sit on the frame.
    fn bounds(v: &[f64]) -> (f64, f64) {
        let pos: Vec<f64> = v
            .iter()
            .copied()
            .filter(|x| *x > 0.0 && x.is_finite())
            .collect();
        let lo = pos.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = pos.iter().copied().fold(0.0, f64::max);
        if !lo.is_finite() || hi <= 0.0 {
            return (0.5, 2.0);
        }
        let (lo, hi) = (lo / 1.5, hi * 1.5);
        if hi / lo < 4.0 {
            (lo / 2.0, hi * 2.0)
        } else {
            (lo, hi)
        }
    }
}
