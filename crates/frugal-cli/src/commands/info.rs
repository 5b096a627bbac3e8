//! `frugal info`: what is inside a GGUF file.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use frugal::gguf::GgufFile;
use frugal::kv::{KvCache, KvFormat, KvType};
use frugal::model::Config;

use super::common::human_bytes;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF file, or a known model's name [default: the default model]
    #[arg(value_parser = super::common::model_arg, conflicts_with = "model_flag")]
    pub model: Option<PathBuf>,
    /// The same, as a flag (as the other commands take it)
    #[arg(short = 'm', long = "model", value_parser = super::common::model_arg)]
    pub model_flag: Option<PathBuf>,
    /// Context for the KV-cache figures [default: the model's training context]
    #[arg(short = 'c', long = "context")]
    pub context: Option<usize>,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    /// Show every element of long metadata arrays
    #[arg(long)]
    pub full: bool,
}

pub fn run(a: Args) -> Result<()> {
    let path = super::common::input_model(a.model.as_deref().or(a.model_flag.as_deref()))?;
    let f = GgufFile::open(&path)?;
    let n_params: u64 = f.tensors().iter().map(|t| t.n_elements()).sum();
    let mut by_type: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
    for t in f.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.n_bytes();
    }
    // Types only frugal reads (the compressed 2:4 storage), each once.
    let mut frugal_only: Vec<frugal::quant::GgmlType> = Vec::new();
    for t in f.tensors() {
        if t.ty.frugal_only() && !frugal_only.contains(&t.ty) {
            frugal_only.push(t.ty);
        }
    }
    // The KV-cache figures need a configuration frugal understands; other files still list.
    let config = Config::from_gguf(&f);
    // A MoE file's active parameters, counted by the estimator (one definition for both).
    let moe = config.as_ref().ok().and_then(|c| c.moe);
    let moe_active = match moe {
        Some(_) => frugal::estimate::gguf_desc::from_gguf(&f, &path.display().to_string())?
            .file_params
            .map(|p| p.active),
        None => None,
    };
    // What llama.cpp's `llama` architecture cannot run: routing other than softmax, renormalized
    // and unscaled, or a selection bias (a tensor it does not expect, so it refuses the file).
    let moe_llama_cpp =
        moe.map(|m| m.llama_cpp_compatible() && f.tensor_info("blk.0.exp_probs_b.bias").is_none());
    let compat = frugal::model::compat::check(&f);
    // Bytes per token as a real (one-token) cache of the file's shape stores them.
    let measure = |c: &Config, ty: KvType| {
        KvCache::measured_bytes_per_token(c.n_layers, c.cache_shape(), KvFormat::both(ty))
            .map(|b| b as u64)
    };
    // At a context: what the cache holds, sliding-window layers only their rings.
    let at = |c: &Config, ty: KvType, ctx: usize| {
        frugal::kv::bytes_at(
            c.n_layers,
            c.cache_shape(),
            KvFormat::both(ty),
            &c.cache_rings(),
            ctx,
        ) as u64
    };
    let kv = match &config {
        Ok(c) => {
            let (b32, b16) = (measure(c, KvType::F32)?, measure(c, KvType::F16)?);
            let ctx = a.context.unwrap_or(c.n_ctx_train);
            anyhow::ensure!(ctx > 0, "--context must be at least 1");
            Some((
                c.kv_elements_per_token() as u64,
                b32,
                b16,
                at(c, KvType::F16, ctx),
                ctx,
            ))
        }
        Err(_) => None,
    };
    if a.json {
        let meta: serde_json::Map<String, serde_json::Value> = f
            .metadata()
            .iter()
            .map(|(k, v)| {
                let long = matches!(v.as_array(), Some(items) if items.len() > 64);
                let j = if long && !a.full {
                    serde_json::Value::String(v.display_short(8))
                } else {
                    v.to_json()
                };
                (k.clone(), j)
            })
            .collect();
        let tensors: Vec<_> = f
            .tensors()
            .iter()
            .map(|t| serde_json::json!({"name": t.name, "type": t.ty.name(), "dims": t.dims, "bytes": t.n_bytes()}))
            .collect();
        let types: serde_json::Map<String, serde_json::Value> = by_type
            .iter()
            .map(|(k, (n, e, b))| {
                (
                    k.to_string(),
                    serde_json::json!({"tensors": n, "elements": e, "bytes": b}),
                )
            })
            .collect();
        let mut out = serde_json::json!({
            "file": path.display().to_string(),
            "file_bytes": f.file_len(),
            "version": f.version,
            "alignment": f.alignment,
            "metadata": meta,
            "tensors": tensors,
            "types": types,
            "n_params": n_params,
            "llama_cpp_readable": compat.llama_cpp_refuses.is_empty(),
            "llama_cpp_refuses": compat.llama_cpp_refuses,
            "llama_cpp_differs": compat.llama_cpp_differs,
            "frugal_runs": compat.frugal.is_ok(),
            "frugal_refuses": compat.frugal.as_ref().err(),
            "n_params_active": moe_active,
            "moe_routing_llama_cpp": moe_llama_cpp,
        });
        match (&config, kv) {
            (Ok(c), Some((elems, b32, b16, full16, ctx))) => {
                out["config"] = serde_json::to_value(c)?;
                out["kv_cache"] = serde_json::json!({
                    "elements_per_token": elems, "bytes_per_token_f32": b32, "bytes_per_token_f16": b16,
                    "context": ctx, "bytes_at_context_f16": full16, "bytes_at_context_f32": full16 * 2,
                    "window_ring_positions": c.cache_rings().summary().1,
                    "windowed_layers": c.cache_rings().summary().0,
                });
            }
            (Err(e), _) => out["config_error"] = e.to_string().into(),
            _ => {}
        }
        println!("{out}");
        return Ok(());
    }
    println!(
        "{}: GGUF v{}, {} ({} bytes), alignment {}",
        path.display(),
        f.version,
        human_bytes(f.file_len()),
        f.file_len(),
        f.alignment
    );
    println!("\nmetadata ({} keys):", f.metadata().len());
    for (k, v) in f.metadata() {
        let shown = if a.full {
            v.to_string()
        } else {
            v.display_short(8)
        };
        println!("  {k:<44} {shown}");
    }
    println!("\ntensors ({}):", f.tensors().len());
    println!(
        "  {:<36} {:<7} {:<20} {:>12}",
        "name", "type", "shape", "bytes"
    );
    for t in f.tensors() {
        println!(
            "  {:<36} {:<7} {:<20} {:>12}",
            t.name,
            t.ty.name(),
            format!("{:?}", t.dims),
            t.n_bytes()
        );
    }
    println!("\nparameters: {n_params} ({:.1} M)", n_params as f64 / 1e6);
    if let (Some(active), Some(m)) = (moe_active, moe) {
        println!(
            "active per token: {active} ({:.1} M; experts routed {} of {}; without the embedding table and the experts a token skips, as `frugal estimate` counts)",
            active as f64 / 1e6,
            m.n_used,
            m.n_expert,
        );
    }
    println!("bytes by type:");
    for (ty, (n, e, b)) in &by_type {
        println!(
            "  {ty:<7} {n:>4} tensors {e:>12} elements {:>12} ({:.2} bits/weight)",
            human_bytes(*b),
            *b as f64 * 8.0 / *e as f64
        );
    }
    match &compat.frugal {
        Ok(()) => println!("\nfrugal: runs this file"),
        Err(e) => println!("\nfrugal: cannot run this file: {e}"),
    }
    if compat.llama_cpp_refuses.is_empty() {
        println!("llama.cpp: loads this file");
    }
    for why in &compat.llama_cpp_refuses {
        println!("llama.cpp: refuses this file: {why}");
    }
    for why in &compat.llama_cpp_differs {
        println!("llama.cpp: computes another model: {why}");
    }
    if !frugal_only.is_empty() {
        let dense: Vec<String> = frugal_only
            .iter()
            .filter_map(|&t| frugal::quant::sparse::dense_type(t))
            .map(|t| t.name().to_lowercase())
            .collect();
        println!(
            "\nfrugal-only tensor types ({}): llama.cpp and other GGUF readers cannot load this file. \
             `frugal quantize {} DENSE.gguf --type {}` writes the same weights in a standard type.",
            frugal_only
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(", "),
            path.display(),
            dense.first().map_or("q8_0", String::as_str)
        );
    }
    match (&config, kv) {
        (Ok(c), Some((elems, b32, b16, full16, ctx))) => {
            match c.mla {
                Some(m) => println!(
                    "\nKV cache (latent attention, one row per layer): {} layers x ({} latent + {} RoPE key) = {elems} elements per token",
                    c.n_layers, m.kv_lora_rank, m.rope_dim
                ),
                None => println!(
                    "\nKV cache: 2 x {} layers x {} KV heads x {} head dim = {elems} elements per token",
                    c.n_layers, c.n_head_kv, c.head_dim
                ),
            }
            println!(
                "  per token, as a cache of this shape stores it: {b32} B in f32, {b16} B in f16"
            );
            if let (Some(sw), (windowed, Some(ring))) =
                (c.features.sliding, c.cache_rings().summary())
            {
                println!(
                    "  sliding window {}: {windowed} of {} layers keep at most {ring} positions \
                     (a ring: the window, {} keys a flash tile may start before it, one pass of {})",
                    sw.window,
                    c.n_layers,
                    frugal::attention::window_lookback(c.head_dim),
                    frugal::kv::RING_CHUNK
                );
            }
            println!(
                "  at a context of {ctx}: {} in f16 ({} B per token), {} in f32",
                human_bytes(full16),
                full16 / ctx as u64,
                human_bytes(full16 * 2)
            );
        }
        (Err(e), _) => println!("\n(no model configuration: {e})"),
        _ => {}
    }
    Ok(())
}
