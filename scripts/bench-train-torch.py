#!/usr/bin/env python3
# Measures PyTorch's CPU training speed on SmolLM2-135M's architecture, as the yardstick for frugal's CPU
# training engine (crates/frugal-train). Trains transformers.LlamaForCausalLM from random init on random
# token ids (no data, no tokenizer, no weights download), in f32 by default, with AdamW, and reports the
# median tokens/s over the measured steps. Needs only torch and transformers; make a venv for them with
# `bash /work/shared/peers/torch-venv` (or any venv with both) and run this script with that venv's python.
# The VM is shared and noisy: compare figures from back-to-back runs, and repeat.
#
# Usage: bench-train-torch.py [--layers 30] [--batch 4] [--seq 512] [--threads 2] [--steps 6] [--warmup 2]
#                             [--bf16-autocast] [--json]
#   --layers 10 is the "student" case; --bf16-autocast shows PyTorch's best CPU case (bf16 matmuls where
#   the CPU has AVX512-BF16/AMX), not a like-for-like f32 comparison.
import argparse
import json
import resource
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def parse_args():
    p = argparse.ArgumentParser(description="PyTorch CPU training-speed benchmark (SmolLM2-135M architecture)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers (30 = full SmolLM2-135M, 10 = student)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--steps", type=int, default=6, help="measured (timed) steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps run first")
    p.add_argument("--bf16-autocast", action="store_true",
                   help="run the forward under torch.autocast('cpu', dtype=torch.bfloat16); weights stay f32")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the human-readable report")
    p.add_argument("--seed", type=int, default=0, help="seed for init and the random token ids")
    return p.parse_args()


def smollm2_135m_config(layers):
    # SmolLM2-135M's config.json, with num_hidden_layers overridable. The legacy `rope_theta` keyword is
    # accepted by every transformers version (v5 folds it into config.rope_parameters).
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=0.041666666666666664,  # SmolLM2's value; irrelevant to speed
        use_cache=False,  # training: no KV cache
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
    )


def peak_rss_mib():
    # ru_maxrss is KiB on Linux (bytes on macOS).
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    # Random init in f32. Attention goes through torch.nn.functional.scaled_dot_product_attention ("sdpa"),
    # causal, no padding mask; PyTorch picks its CPU flash-attention kernel for this case.
    model = LlamaForCausalLM(smollm2_135m_config(a.layers))  # f32: torch's default dtype
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model = model.float().train()  # .float() is a no-op unless torch's default dtype was changed
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once

    # AdamW with the CPU default implementation (foreach on recent torch; fused is not chosen by default).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    # Random token ids, one fixed batch (the same data every step: speed doesn't depend on it). labels =
    # input_ids: LlamaForCausalLM shifts them inside its loss.
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), generator=g)

    def step():
        # One timed unit: forward + backward + optimizer.step + zero_grad.
        if a.bf16_autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    tokens = a.batch * a.seq
    losses = []
    for i in range(a.warmup):
        t0 = time.perf_counter()
        loss = step()
        if not a.json:
            print(f"warmup {i + 1}/{a.warmup}: {time.perf_counter() - t0:.2f} s, loss {loss:.4f}", file=sys.stderr)
    step_s = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        step_s.append(dt)
        losses.append(loss)
        if not a.json:
            print(f"step {i + 1}/{a.steps}: {dt:.2f} s, {tokens / dt:.1f} tokens/s, loss {loss:.4f}",
                  file=sys.stderr)

    median_s = statistics.median(step_s)
    res = {
        "framework": "pytorch",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn": "sdpa",
        "dtype": "f32+bf16-autocast" if a.bf16_autocast else "f32",
        "layers": a.layers,
        "params": n_params,
        "batch": a.batch,
        "seq": a.seq,
        "threads": a.threads,
        "tokens_per_s_median": round(tokens / median_s, 2),
        "step_s": [round(s, 4) for s in step_s],
        "final_loss": round(losses[-1], 4) if losses else None,
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(f"pytorch {torch.__version__} ({res['dtype']}, sdpa): {a.layers} layers, {n_params / 1e6:.1f} M params, "
              f"batch {a.batch} x {a.seq}, {a.threads} threads: median {res['tokens_per_s_median']:.1f} tokens/s "
              f"(median step {median_s:.2f} s), peak RSS {res['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
