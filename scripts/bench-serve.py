#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (frugal serve, llama-server, vLLM), measured the
way `vllm bench serve` measures, with only the Python standard library (asyncio streams speaking
HTTP/1.1, one connection per request).

For each level in --concurrency it sends --num-prompts requests (default max(8, 2 x level)) with
that many in flight (closed loop: a finished request is replaced at once, like vllm's
--max-concurrency with --request-rate inf) and reports:

  output tok/s   sum of usage.completion_tokens (else content chunks) / wall time of the level
  req/s          completed requests / wall time
  TTFT           send -> first chunk carrying generated text (p50, p99)
  ITL            gaps between successive content chunks, pooled over requests (p50, p99)
  TPOT           per request (latency - TTFT) / (output tokens - 1), latency = send -> last content chunk
  E2E            send -> end of the response
  errors         requests that did not finish with HTTP 200, a content chunk and no error event

Prompts are random common English words, trimmed with the server's /tokenize to --input-len
tokens (when /tokenize is missing, one word counts as one token). --prefix-len N puts the same
N-token text in front of every prompt (shared-prefix load). --prefix-ttft measures prefix-cache
benefit: TTFT of a --prefix-ttft-len-token prompt the server has never seen (cold) against the
same prefix with a different short suffix right after (warm), --prefix-ttft-reps times, each
repetition with a fresh prefix.

Requests ask for exactly --output-len tokens: "max_tokens": N plus "ignore_eos": true (llama-server
and vLLM honour it) and "min_tokens": N (vLLM); servers that ignore both may stop early at EOS,
which the "short" column counts.

Usage: bench-serve.py --base-url http://127.0.0.1:8080 [--concurrency 1,4,16,64] [--prefix-ttft]
                      [--json out.json | --json -]
"""
import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
import urllib.parse

WORDS = """
the of and to in is was for that on as with by he at from his it an were are which this be or
has had not first one their its new after but who they two her she been other when there all
during into school time may years more most only over city some world would where later up
such used many can state about national out known university united then made year part
american could these between under team three both season through being film against people
war any series country well including game work back since group music number called north
family south four house high several like early well life name album second each year area
water city place line river light power state story point order field house land body voice
road world child plan head hand week money night word market book eye job study business issue
side kind member side month case week company system program question government number night
point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law
car city community name president team minute idea kid body information back parent face
others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy music process
market sense nation plan college interest death experience effect use class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure
street image phone data picture practice piece land product doctor wall patient worker news
test movie north love support technology step baby computer type attention film tree source
organization hair window evidence population truth song range garden stone bridge summer
winter spring island forest mountain valley ocean desert village castle engine machine signal
letter paper bottle glass chair table window floor kitchen garden market station doctor
lawyer farmer artist writer singer player driver pilot captain soldier student teacher
""".split()


def die(msg):
    print(f"bench-serve: {msg}", file=sys.stderr)
    sys.exit(2)


# --------------------------------------------------------------------------------------------
# HTTP/1.1 over asyncio streams
# --------------------------------------------------------------------------------------------

class HttpError(Exception):
    pass


async def _open(url, method, path, body, timeout):
    host, port = url.hostname, url.port or 80
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, limit=1 << 20), timeout)
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "User-Agent: frugal-bench-serve\r\nAccept: application/json, text/event-stream\r\n"
            "Connection: close\r\n")
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    writer.write(head.encode() + b"\r\n" + data)
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), timeout)
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        writer.close()
        raise HttpError(f"bad status line {status_line[:80]!r}")
    status = int(parts[1])
    headers = {}
    while True:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if line in (b"\r\n", b"\n", b""):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return reader, writer, status, headers


async def _body_pieces(reader, headers, timeout):
    """Yields the response body as it arrives (chunked, Content-Length or until EOF)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                raise HttpError("connection closed inside a chunked body")
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b"\n", b""):
                    pass
                return
            piece = await asyncio.wait_for(reader.readexactly(size), timeout)
            await asyncio.wait_for(reader.readexactly(2), timeout)
            yield piece
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            piece = await asyncio.wait_for(reader.read(min(left, 1 << 16)), timeout)
            if not piece:
                raise HttpError("connection closed before Content-Length bytes")
            left -= len(piece)
            yield piece
    else:
        while True:
            piece = await asyncio.wait_for(reader.read(1 << 16), timeout)
            if not piece:
                return
            yield piece


async def http_json(url, method, path, body=None, timeout=60.0):
    """One request; returns (status, parsed JSON or raw text)."""
    reader, writer, status, headers = await _open(url, method, path, body, timeout)
    try:
        raw = b"".join([p async for p in _body_pieces(reader, headers, timeout)])
    finally:
        writer.close()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------
# One streamed completion
# --------------------------------------------------------------------------------------------

def _chunk_text(obj, chat):
    choices = obj.get("choices") or []
    if not choices:
        return None, None
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
    return text, c.get("finish_reason")


async def stream_request(url, path, body, timeout, chat):
    """Sends one streaming request; returns a dict with the timings vllm bench serve records."""
    r = {"ok": False, "error": None, "status": None, "ttft": None, "itl": [], "latency": None,
         "e2e": None, "content_chunks": 0, "completion_tokens": None, "prompt_tokens": None,
         "cached_tokens": None, "finish_reason": None, "text_len": 0}
    t0 = time.perf_counter()
    r["start"] = t0
    last = None
    done = False
    writer = None
    try:
        reader, writer, status, headers = await _open(url, "POST", path, body, timeout)
        r["status"] = status
        if status != 200:
            raw = b"".join([p async for p in _body_pieces(reader, headers, timeout)])
            msg = raw.decode("utf-8", "replace")
            try:
                msg = json.loads(msg)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            r["error"] = f"HTTP {status}: {str(msg)[:200]}"
            return r
        buf = b""
        async for piece in _body_pieces(reader, headers, timeout):
            now = time.perf_counter()
            buf += piece
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue  # comments (": ping"), event:, id:
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        continue
                    obj = json.loads(payload)
                    if "error" in obj:
                        err = obj["error"]
                        r["error"] = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)[:200]
                        return r
                    text, finish = _chunk_text(obj, chat)
                    if finish:
                        r["finish_reason"] = finish
                    if text:
                        if last is None:
                            r["ttft"] = now - t0
                        else:
                            r["itl"].append(now - last)
                        last = now
                        r["content_chunks"] += 1
                        r["text_len"] += len(text)
                    usage = obj.get("usage")
                    if usage:
                        r["completion_tokens"] = usage.get("completion_tokens")
                        r["prompt_tokens"] = usage.get("prompt_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        r["cached_tokens"] = details.get("cached_tokens")
        r["e2e"] = time.perf_counter() - t0
        if last is None:
            r["error"] = "no content chunk"
            return r
        r["latency"] = last - t0
        if not done:
            r["error"] = "stream ended without [DONE]"
            return r
        r["ok"] = True
        return r
    except asyncio.TimeoutError:
        r["error"] = f"timeout after {timeout:g} s"
        return r
    except (OSError, HttpError, ValueError, asyncio.IncompleteReadError) as e:
        r["error"] = f"{type(e).__name__}: {e}"[:200]
        return r
    finally:
        r["end"] = time.perf_counter()
        if writer is not None:
            writer.close()


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------

class Prompts:
    def __init__(self, url, use_tokenizer, timeout):
        self.url = url
        self.use_tokenizer = use_tokenizer
        self.timeout = timeout
        self.calls = 0

    async def count(self, text):
        if not self.use_tokenizer:
            return len(text.split())
        status, obj = await http_json(self.url, "POST", "/tokenize",
                                      {"content": text, "add_special": False}, self.timeout)
        self.calls += 1
        if status != 200 or not isinstance(obj, dict) or "tokens" not in obj:
            print(f"bench-serve: /tokenize answered {status}; counting one token per word",
                  file=sys.stderr)
            self.use_tokenizer = False
            return len(text.split())
        return len(obj["tokens"])

    async def make(self, rng, n_tokens, lead=""):
        """Random words whose tokens (after `lead`, counted together) number about n_tokens."""
        if n_tokens <= 0:
            return ""
        base = await self.count(lead) if lead else 0
        words = [rng.choice(WORDS) for _ in range(n_tokens)]
        for _ in range(8):
            text = " ".join(words)
            n = (await self.count(lead + text) - base) if lead else await self.count(text)
            if n == n_tokens:
                break
            if n > n_tokens:
                drop = n - n_tokens
                if drop >= len(words):
                    del words[1:]
                    break
                del words[len(words) - drop:]
            else:
                words += [rng.choice(WORDS) for _ in range(n_tokens - n)]
        return " ".join(words)


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------

def pct(xs, p):
    """Percentile with linear interpolation (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def summarize(level, results, duration, output_len, load_before, load_after):
    ok = [r for r in results if r["ok"]]
    out = []
    for r in ok:
        n = r["completion_tokens"] if r["completion_tokens"] is not None else r["content_chunks"]
        out.append(n)
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    tpot = [(r["latency"] - r["ttft"]) / (n - 1) for r, n in zip(ok, out) if n > 1]
    e2e = [r["e2e"] for r in ok]
    ms = lambda x: None if x is None else x * 1000.0
    errors = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    total_out = sum(out)
    prompt = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    return {
        "concurrency": level,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "short": sum(1 for n in out if n < output_len),
        "duration_s": duration,
        "total_output_tokens": total_out,
        "total_input_tokens": sum(prompt),
        "cached_input_tokens": sum(cached),
        "mean_prompt_tokens": statistics.mean(prompt) if prompt else None,
        "output_throughput": total_out / duration if duration > 0 else None,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "total_token_throughput": (total_out + sum(prompt)) / duration if duration > 0 else None,
        "ttft_ms_mean": ms(statistics.mean(ttft)) if ttft else None,
        "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
        "itl_ms_mean": ms(statistics.mean(itl)) if itl else None,
        "itl_ms_p50": ms(pct(itl, 50)), "itl_ms_p99": ms(pct(itl, 99)),
        "tpot_ms_mean": ms(statistics.mean(tpot)) if tpot else None,
        "tpot_ms_p50": ms(pct(tpot, 50)), "tpot_ms_p99": ms(pct(tpot, 99)),
        "e2e_ms_p50": ms(pct(e2e, 50)), "e2e_ms_p99": ms(pct(e2e, 99)),
        "per_stream_tok_s": 1000.0 / ms(statistics.mean(tpot)) if tpot else None,
        "load1_before": load_before, "load1_after": load_after,
    }


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.url = urllib.parse.urlsplit(args.base_url)
        self.chat = args.endpoint.rstrip("/").endswith("chat/completions")
        self.prompts = Prompts(self.url, not args.no_tokenize, args.timeout)
        self.model = args.model

    def body(self, prompt, max_tokens, ignore_eos=True):
        a = self.args
        b = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
             "max_tokens": max_tokens, "temperature": a.temperature}
        if self.chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if ignore_eos and not a.no_ignore_eos:
            b["ignore_eos"] = True
            b["min_tokens"] = max_tokens
        if a.extra_body:
            b.update(json.loads(a.extra_body))
        return b

    async def one(self, prompt, max_tokens):
        return await stream_request(self.url, self.args.endpoint, self.body(prompt, max_tokens),
                                    self.args.timeout, self.chat)

    async def discover(self):
        status, obj = await http_json(self.url, "GET", "/v1/models", None, self.args.timeout)
        if status != 200 or not isinstance(obj, dict) or not obj.get("data"):
            die(f"GET /v1/models answered {status}: {str(obj)[:200]}")
        info = obj["data"][0]
        if self.model is None:
            self.model = info["id"]
        return info

    async def level(self, c, shared_prefix):
        a = self.args
        n = a.num_prompts or max(8, 2 * c)
        prompts = []
        for i in range(n):
            rng = random.Random(f"{a.seed}/level{c}/{i}")
            lead = shared_prefix + " " if shared_prefix else ""
            prompts.append(lead + await self.prompts.make(rng, a.input_len, lead))
        queue = list(enumerate(prompts))
        results = [None] * n

        async def worker():
            while queue:
                i, p = queue.pop(0)
                results[i] = await self.one(p, a.output_len)

        load_before = loadavg()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(c, n))))
        duration = max(r["end"] for r in results) - t0
        return summarize(c, results, duration, a.output_len, load_before, loadavg())

    async def prefix_ttft(self):
        a = self.args
        rows = []
        for rep in range(a.prefix_ttft_reps):
            rng = random.Random(f"{a.seed}/prefix-ttft/{rep}/{time.time_ns()}")
            prefix = await self.prompts.make(rng, a.prefix_ttft_len)
            s1 = await self.prompts.make(rng, a.prefix_ttft_suffix, prefix + " ")
            s2 = await self.prompts.make(rng, a.prefix_ttft_suffix, prefix + " ")
            cold = await self.one(prefix + " " + s1, a.prefix_ttft_output)
            warm = await self.one(prefix + " " + s2, a.prefix_ttft_output)
            rows.append((cold, warm))
        ok = [(c, w) for c, w in rows if c["ok"] and w["ok"]]
        errs = [r["error"] for pair in rows for r in pair if not r["ok"]]
        cold = [c["ttft"] * 1000 for c, _ in ok]
        warm = [w["ttft"] * 1000 for _, w in ok]
        cached = [w["cached_tokens"] for _, w in ok if w["cached_tokens"] is not None]
        cached_cold = [c["cached_tokens"] for c, _ in ok if c["cached_tokens"] is not None]
        prompt = [c["prompt_tokens"] for c, _ in ok if c["prompt_tokens"] is not None]
        return {
            "prompt_tokens": statistics.median(prompt) if prompt else None,
            "prefix_tokens": a.prefix_ttft_len, "suffix_tokens": a.prefix_ttft_suffix,
            "reps": len(rows), "ok": len(ok), "errors": errs,
            "cold_ttft_ms": cold, "warm_ttft_ms": warm,
            "cold_ttft_ms_p50": statistics.median(cold) if cold else None,
            "warm_ttft_ms_p50": statistics.median(warm) if warm else None,
            "cold_over_warm_median": statistics.median([c / w for c, w in zip(cold, warm)]) if ok else None,
            "warm_cached_tokens_p50": statistics.median(cached) if cached else None,
            "cold_cached_tokens_p50": statistics.median(cached_cold) if cached_cold else None,
        }

    async def run(self):
        a = self.args
        info = await self.discover()
        report = {"base_url": a.base_url, "label": a.label, "model": self.model,
                  "model_info": {k: info.get(k) for k in ("id", "root", "max_model_len", "owned_by")},
                  "config": {k: getattr(a, k) for k in (
                      "endpoint", "input_len", "output_len", "prefix_len", "num_prompts", "seed",
                      "temperature", "no_ignore_eos", "warmup")},
                  "levels": [], "prefix_ttft": None}
        for i in range(a.warmup):
            w = await self.one(await self.prompts.make(random.Random(f"warm{i}/{time.time_ns()}"), 16), 16)
            if not w["ok"]:
                die(f"warm-up request failed: {w['error']}")
        shared = ""
        if a.prefix_len > 0:
            shared = await self.prompts.make(random.Random(f"{a.seed}/shared-prefix"), a.prefix_len)
        for c in a.levels:
            row = await self.level(c, shared)
            report["levels"].append(row)
            if not a.quiet:
                print(f"bench-serve: {a.label or a.base_url}: {c} in flight: "
                      f"{row['completed']}/{row['requests']} ok, {fmt(row['output_throughput'])} tok/s, "
                      f"TTFT p50 {fmt(row['ttft_ms_p50'])} ms", file=sys.stderr)
        if a.prefix_ttft:
            report["prefix_ttft"] = await self.prefix_ttft()
        report["tokenize_calls"] = self.prompts.calls
        report["tokenizer_used"] = self.prompts.use_tokenizer
        return report


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(report):
    lines = []
    title = report.get("label") or report["base_url"]
    cfg = report["config"]
    if report["levels"]:
        lines.append(f"**{title}** (`{report['model']}`): {cfg['endpoint']}, input {cfg['input_len']}"
                     + (f" + shared prefix {cfg['prefix_len']}" if cfg["prefix_len"] else "")
                     + f" tokens, output {cfg['output_len']} tokens, stream")
        lines.append("")
        lines.append("| in flight | requests | errors | short | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms "
                     "| ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms | E2E p50 ms | cached prompt tok | load1 |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in report["levels"]:
            lines.append(
                f"| {r['concurrency']} | {r['requests']} | {r['failed']} | {r['short']} | "
                f"{fmt(r['output_throughput'])} | {fmt(r['request_throughput'], 2)} | "
                f"{fmt(r['ttft_ms_p50'])} | {fmt(r['ttft_ms_p99'])} | {fmt(r['itl_ms_p50'], 2)} | "
                f"{fmt(r['itl_ms_p99'], 2)} | {fmt(r['tpot_ms_p50'], 2)} | {fmt(r['tpot_ms_p99'], 2)} | "
                f"{fmt(r['e2e_ms_p50'], 0)} | {r['cached_input_tokens']}/{r['total_input_tokens']} | "
                f"{fmt(r['load1_before'], 2)} |")
        for r in report["levels"]:
            for e, n in r["errors"].items():
                lines.append(f"\n{r['concurrency']} in flight: {n} x {e}")
    p = report.get("prefix_ttft")
    if p:
        lines.append("")
        lines.append(f"**{title}**: prefix cache, TTFT of a {p['prefix_tokens']}+{p['suffix_tokens']}-token "
                     "prompt, cold (prefix never seen) vs warm (same prefix, new suffix)")
        lines.append("")
        lines.append("| prompt tokens | reps ok | cold TTFT p50 ms | warm TTFT p50 ms | cold/warm (median) "
                     "| cached tokens warm (p50) |")
        lines.append("|---:|---:|---:|---:|---:|---:|")
        lines.append(f"| {fmt(p['prompt_tokens'], 0)} | {p['ok']}/{p['reps']} | {fmt(p['cold_ttft_ms_p50'])} | "
                     f"{fmt(p['warm_ttft_ms_p50'])} | {fmt(p['cold_over_warm_median'], 2)} | "
                     f"{fmt(p['warm_cached_tokens_p50'], 0)} |")
        for e in p["errors"]:
            lines.append(f"\nprefix-ttft error: {e}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--endpoint", default="/v1/completions",
                    help="/v1/completions (default) or /v1/chat/completions")
    ap.add_argument("--model", help="model name to send (default: data[0].id of GET /v1/models)")
    ap.add_argument("--concurrency", default="1,4,16,64",
                    help="comma-separated levels; empty to skip the sweep (e.g. with --prefix-ttft)")
    ap.add_argument("--num-prompts", type=int, default=0, help="requests per level (default max(8, 2 x level))")
    ap.add_argument("--input-len", type=int, default=128, help="random prompt length in tokens")
    ap.add_argument("--output-len", type=int, default=128, help="max_tokens (with ignore_eos)")
    ap.add_argument("--prefix-len", type=int, default=0, help="shared prefix in front of every prompt, tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos / min_tokens")
    ap.add_argument("--no-tokenize", action="store_true", help="do not call /tokenize; one word = one token")
    ap.add_argument("--extra-body", help="JSON object merged into every request body")
    ap.add_argument("--warmup", type=int, default=1, help="short requests sent before measuring")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for any one read (the status line, each chunk)")
    ap.add_argument("--prefix-ttft", action="store_true", help="also measure cold vs warm prefix TTFT")
    ap.add_argument("--prefix-ttft-len", type=int, default=1000)
    ap.add_argument("--prefix-ttft-suffix", type=int, default=16)
    ap.add_argument("--prefix-ttft-reps", type=int, default=5)
    ap.add_argument("--prefix-ttft-output", type=int, default=4, help="max_tokens of those requests")
    ap.add_argument("--label", default="", help="name for the table title")
    ap.add_argument("--json", help="write the full report as JSON to this path ('-' = stdout; the table then goes to stderr)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args()
    try:
        a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    except ValueError:
        die(f"bad --concurrency {a.concurrency!r}")
    if any(c < 1 for c in a.levels):
        die("concurrency levels must be >= 1")
    if not a.levels and not a.prefix_ttft:
        die("nothing to do: empty --concurrency and no --prefix-ttft")
    if urllib.parse.urlsplit(a.base_url).scheme != "http":
        die("only http:// base URLs are supported")
    report = asyncio.run(Bench(a).run())
    table = markdown(report)
    if a.json == "-":
        print(table, file=sys.stderr)
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(table)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
