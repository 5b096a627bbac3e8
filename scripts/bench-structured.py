#!/usr/bin/env python3
"""The cost of constrained decoding per token: json_schema requests against unconstrained ones
on the same prompts, back to back against one running `frugal serve`.

Each round sends one prompt twice, streamed and greedy, one request at a time: first with a
JSON schema, then without one, asking for exactly as many tokens as the constrained answer had
(`ignore_eos`). The time per token is the mean gap between streamed tokens after the first
(so prefill is left out). Rounds alternate which request goes first, so drift in the machine's
speed hits both alike. Prints both, and their ratio.

    frugal serve --port 8080 &
    python3 scripts/bench-structured.py --url http://127.0.0.1:8080 --rounds 12
"""

import argparse
import json
import statistics
import time
import urllib.request

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {
            "type": "array",
            "items": {"enum": ["drama", "comedy", "action", "horror", "romance"]},
            "minItems": 1,
            "maxItems": 4,
        },
        "cast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "role": {"type": "string", "maxLength": 30},
                },
                "required": ["name", "role"],
            },
            "minItems": 3,
            "maxItems": 6,
        },
    },
    "required": ["title", "year", "genres", "cast"],
}

PROMPTS = [
    "Describe a famous film as JSON.",
    "Invent a science fiction movie and give its details as JSON.",
    "Give the details of a comedy from the 1990s as JSON.",
    "Describe your favourite movie in JSON.",
]


def stream(url, body):
    """Per-token arrival times of a streamed chat completion, and the tokens counted."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    times = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    return times


def per_token(times):
    return (times[-1] - times[0]) / (len(times) - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    fmt = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA}}
    constrained, free = [], []
    for i in range(args.rounds):
        msgs = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        base = {"messages": msgs, "temperature": 0, "max_tokens": 400}
        # The constrained answer's length fixes the unconstrained one's.
        t_c = stream(args.url, {**base, "response_format": fmt})
        n = len(t_c)
        plain = {**base, "max_tokens": n, "ignore_eos": True}
        if i % 2:
            t_f = stream(args.url, plain)
            t_c = stream(args.url, {**base, "response_format": fmt})
        else:
            t_f = stream(args.url, plain)
        constrained.append(per_token(t_c))
        free.append(per_token(t_f))
        print(f"round {i}: {n} tokens; json_schema {per_token(t_c) * 1e3:.2f} ms/token, "
              f"unconstrained {per_token(t_f) * 1e3:.2f} ms/token")
    c, f = statistics.median(constrained), statistics.median(free)
    print(f"median ms/token: json_schema {c * 1e3:.2f}, unconstrained {f * 1e3:.2f}; "
          f"ratio {c / f:.3f} ({(c / f - 1) * 100:+.1f}% per token)")


if __name__ == "__main__":
    main()
