#!/usr/bin/env python3
"""Logits of frugal's small synthetic GGUF models computed by Hugging Face `transformers`, written as
the JSON fixtures `crates/frugal/tests/families_transformers.rs` compares frugal against.

Usage (see that test's module doc):

    FRUGAL_WRITE_TRANSFORMERS_MODELS=/tmp/hf-models \\
      cargo test --release -p frugal --test families_transformers write_models
    python scripts/transformers-reference.py /tmp/hf-models crates/frugal/tests/fixtures/transformers

The first command writes each model's GGUF file and `manifest.json` (token ids, the context frugal
configures, what the script needs that a file does not say). Needs torch, transformers (5.x; written
against 5.25), gguf and accelerate (transformers refuses GGUF files without it; where the venv lacks
it: `pip install --no-deps --target DIR accelerate psutil`, then run with PYTHONPATH=DIR); CPU only.
The fixtures were made with transformers 5.25.0, torch 2.15.0 and accelerate 1.16.0.

How each model is built in transformers
---------------------------------------
Every model starts from `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)`,
transformers' own GGUF loader (name mapping, un-permutation of llama's Q/K rows, Gemma's `norm - 1`,
fused Phi-3 tensors). Then, per model (`BUILDERS` below):

* path "gguf": that model as loaded. Used where the loader keeps everything the file says:
  `llama_gqa` (plain llama, GQA), `qwen2` (biases), `qwen3` (the loader maps no `key_length` for
  qwen3 and relies on Qwen3Config's head_dim 128, so the synthetic file has head width 128).
* path "config": the loader drops a feature, so a model is built from an explicit config that
  carries it (every value read from the GGUF metadata and tensors, except Llama 3's parameters,
  which a file does not hold: from the manifest), and the loaded model's state dict (the loader's
  weights) is loaded into it with `strict=True`:
  - `llama_rope_freqs_llama3`: LlamaConfig, rope_type llama3 (the loader ignores `rope_freqs`);
    the script checks that HF's llama3 frequencies divided into the plain ones give the file's
    `rope_freqs` (to 1e-6).
  - `llama_linear`: LlamaConfig, rope_type linear with the file's `rope.scaling.factor` (the loader
    maps no `rope.scaling.*`).
  - `qwen2_yarn`: Qwen2Config, rope_type yarn with the file's factor and
    `original_context_length` (beta_fast 32 and beta_slow 1 are HF's defaults as well as
    llama.cpp's fixed values for qwen2; attention factor HF's default 0.1 ln(factor) + 1).
  - `phi3_partial_short`, `phi3_long`: Phi3Config, rope_type longrope with the file's
    `rope_factors_long/short`, `original_max_position_embeddings` from the file, and
    `partial_rotary_factor = rope.dimension_count / head width` (the loader maps none of these).
    HF computes the attention factor itself from max_position_embeddings / original (the
    converter's formula; the file's `rope.scaling.attn_factor` is checked against it) and picks
    the long factors when the sequence is longer than the original context: the short case's
    sequence (12) is within its original context (32), the long case's exceeds its (8). frugal
    picks by configured context, which the manifest states (32 and the training 256).
  - `gemma3`: Gemma3TextConfig with `query_pre_attn_scalar` = the head width (llama.cpp's rule for
    every Gemma 3 but the 27B; the loader leaves HF's default 256), `sliding_window` from the file,
    `layer_types` from `sliding_window_pattern` (layer l global iff l % period == period - 1), RoPE
    per layer type: full_attention linear with the file's factor and `rope.freq_base`,
    sliding_attention default with base 10000 (the loader maps no scaling and no local base).

Every model runs with eager attention in f32, on the manifest's token ids as one sequence (positions
0..n-1), and all positions' logits are written. Models that could not be matched: none.
"""

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGUFReader
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class Gguf:
    """Metadata and F32 tensors of a GGUF file, read with the `gguf` package."""

    def __init__(self, path):
        self.r = GGUFReader(str(path))
        self.arch = self.r.fields["general.architecture"].contents()

    def get(self, key, default=None):
        f = self.r.fields.get(f"{self.arch}.{key}")
        return default if f is None else f.contents()

    def tensor(self, name):
        for t in self.r.tensors:
            if t.name == name:
                return np.array(t.data, dtype=np.float32)
        return None

    def common(self):
        """The config values every family shares."""
        n_embd = self.get("embedding_length")
        n_head = self.get("attention.head_count")
        return dict(
            vocab_size=len(self.r.fields["tokenizer.ggml.tokens"].contents()),
            hidden_size=n_embd,
            intermediate_size=self.get("feed_forward_length"),
            num_hidden_layers=self.get("block_count"),
            num_attention_heads=n_head,
            num_key_value_heads=self.get("attention.head_count_kv", n_head),
            head_dim=self.get("attention.key_length", n_embd // n_head),
            max_position_embeddings=self.get("context_length"),
            rms_norm_eps=self.get("attention.layer_norm_rms_epsilon"),
            tie_word_embeddings=self.tensor("output.weight") is None,
        )


def rebuild(cls, config, loaded):
    """`cls(config)` with the GGUF loader's weights."""
    config._attn_implementation = "eager"
    model = cls(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return model.eval()


def as_loaded(g, loaded, hints):
    return loaded, "gguf", "AutoModelForCausalLM.from_pretrained(gguf_file=...) as loaded"


def llama_llama3(g, loaded, hints):
    p = hints["llama3"]
    c = g.common()
    rope = dict(rope_type="llama3", rope_theta=g.get("rope.freq_base"), **p)
    config = LlamaConfig(**c, rope_parameters=rope)
    # The file's rope_freqs must be HF's llama3 rule: plain inv_freq / llama3 inv_freq.
    plain, _ = ROPE_INIT_FUNCTIONS["linear"](
        LlamaConfig(**c, rope_parameters=dict(rope_type="linear", factor=1.0, rope_theta=rope["rope_theta"])),
        "cpu",
    )
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    want = g.tensor("rope_freqs.weight")
    got = (plain / hf).numpy()
    assert np.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    return (
        rebuild(LlamaForCausalLM, config, loaded),
        "config",
        f"LlamaConfig(rope_parameters={rope}) + the GGUF loader's weights; "
        "the file's rope_freqs checked against HF's llama3 frequencies",
    )


def llama_linear(g, loaded, hints):
    rope = dict(rope_type="linear", factor=g.get("rope.scaling.factor"), rope_theta=g.get("rope.freq_base"))
    config = LlamaConfig(**g.common(), rope_parameters=rope)
    return (
        rebuild(LlamaForCausalLM, config, loaded),
        "config",
        f"LlamaConfig(rope_parameters={rope}) + the GGUF loader's weights",
    )


def qwen2_yarn(g, loaded, hints):
    assert g.get("rope.scaling.type") == "yarn"
    rope = dict(
        rope_type="yarn",
        factor=g.get("rope.scaling.factor"),
        original_max_position_embeddings=g.get("rope.scaling.original_context_length"),
        rope_theta=g.get("rope.freq_base"),
    )
    config = Qwen2Config(**g.common(), rope_parameters=rope)
    return (
        rebuild(Qwen2ForCausalLM, config, loaded),
        "config",
        f"Qwen2Config(rope_parameters={rope}) + the GGUF loader's weights",
    )


def phi3(g, loaded, hints):
    c = g.common()
    orig = g.get("rope.scaling.original_context_length")
    partial = g.get("rope.dimension_count") / c["head_dim"]
    rope = dict(
        rope_type="longrope",
        long_factor=[float(x) for x in g.tensor("rope_factors_long.weight")],
        short_factor=[float(x) for x in g.tensor("rope_factors_short.weight")],
        rope_theta=g.get("rope.freq_base"),
        partial_rotary_factor=partial,
    )
    config = Phi3Config(
        **c, rope_parameters=rope, original_max_position_embeddings=orig, sliding_window=None, pad_token_id=None
    )
    _, attn = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    assert math.isclose(attn, g.get("rope.scaling.attn_factor"), rel_tol=1e-6), attn
    return (
        rebuild(Phi3ForCausalLM, config, loaded),
        "config",
        f"Phi3Config(rope_parameters=longrope with the file's long/short factors, "
        f"partial_rotary_factor={partial}, original_max_position_embeddings={orig}, "
        f"max_position_embeddings={c['max_position_embeddings']}) + the GGUF loader's weights "
        f"(HF's attention factor {attn:.7f} = the file's rope.scaling.attn_factor)",
    )


def gemma3(g, loaded, hints):
    c = g.common()
    period = g.get("attention.sliding_window_pattern", 6)
    layer_types = [
        "full_attention" if l % period == period - 1 else "sliding_attention" for l in range(c["num_hidden_layers"])
    ]
    full = dict(rope_type="default", rope_theta=g.get("rope.freq_base"))
    if g.get("rope.scaling.type", "linear") == "linear" and g.get("rope.scaling.factor", 1.0) != 1.0:
        full = dict(rope_type="linear", factor=g.get("rope.scaling.factor"), rope_theta=g.get("rope.freq_base"))
    rope = dict(full_attention=full, sliding_attention=dict(rope_type="default", rope_theta=10000.0))
    config = Gemma3TextConfig(
        **c,
        query_pre_attn_scalar=c["head_dim"],
        sliding_window=g.get("attention.sliding_window"),
        layer_types=layer_types,
        rope_parameters=rope,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh",
    )
    return (
        rebuild(Gemma3ForCausalLM, config, loaded),
        "config",
        f"Gemma3TextConfig(query_pre_attn_scalar={c['head_dim']}, sliding_window={config.sliding_window}, "
        f"layer_types={layer_types}, rope_parameters={rope}) + the GGUF loader's weights",
    )


BUILDERS = {
    "llama_gqa": as_loaded,
    "llama_rope_freqs_llama3": llama_llama3,
    "llama_linear": llama_linear,
    "qwen2": as_loaded,
    "qwen2_yarn": qwen2_yarn,
    "qwen3": as_loaded,
    "phi3_partial_short": phi3,
    "phi3_long": phi3,
    "gemma3": gemma3,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, help="directory the test wrote (GGUF files and manifest.json)")
    ap.add_argument("out", type=Path, help="fixture directory")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    manifest = json.loads((args.models / "manifest.json").read_text())
    tokens = manifest["tokens"]
    args.out.mkdir(parents=True, exist_ok=True)
    names = set()
    for m in manifest["models"]:
        name, file = m["name"], m["file"]
        names.add(name)
        build = BUILDERS.get(name)
        if build is None:
            sys.exit(f"{name}: no builder; add one to BUILDERS")
        data = (args.models / file).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        assert sha == m["sha256"], f"{file}: not the file the manifest describes"
        g = Gguf(args.models / file)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(args.models),
            gguf_file=file,
            dtype=torch.float32,
            attn_implementation="eager",
            # Phi3Config's default pad id (32000) is past the 258-token vocabulary, which
            # nn.Embedding refuses; it plays no part in a forward pass.
            pad_token_id=None,
        ).eval()
        model, path, how = build(g, loaded, m["hf"])
        logits = model(torch.tensor([tokens])).logits[0].to(torch.float32).numpy()
        assert logits.shape == (len(tokens), g.common()["vocab_size"]), logits.shape
        fixture = {
            "model": name,
            "gguf_file": file,
            "gguf_sha256": sha,
            "tokens": tokens,
            "n_vocab": int(logits.shape[1]),
            "frugal_context": m["frugal_context"],
            "hf_path": path,
            "hf_model_class": type(model).__name__,
            "hf_how": how,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "logits": "@LOGITS@",
        }
        # f32 values, each printed with the 9 significant digits that round-trip an f32.
        rows = ",\n    ".join("[" + ",".join(f"{float(v):.9g}" for v in row) + "]" for row in logits)
        text = json.dumps(fixture, indent=1).replace('"@LOGITS@"', "[\n    " + rows + "\n  ]")
        (args.out / f"{name}.json").write_text(text + "\n")
        print(f"{name:<26} {path:<6} {type(model).__name__:<18} max |logit| {np.abs(logits).max():.3f}")
    missing = set(BUILDERS) - names
    if missing:
        print(f"note: builders without a model in the manifest: {sorted(missing)}")


if __name__ == "__main__":
    main()
