"""`frugal serve`'s limits and validation, through the official `openai` client and raw HTTP.

- Validation (main server): every OpenAI field is honoured or refused with a 400 naming it.
- Limits (a second server with an API key, CORS, a tiny body limit, a short timeout and a fast
  keep-alive): 401, CORS headers, 413, 504 and the generation stopped, SSE keep-alive.
- Slow and vanished clients (main server): neither holds the scheduler.

Run through tests/serve/run.sh (with test_openai.py, which holds the harness).
"""

import json
import socket
import threading
import urllib.parse

import httpx
import openai
import pytest

from test_openai import PROMPTS, Server, _wait_for, error_body, get_metrics, metric, ok_request

MSG = [{"role": "user", "content": "Hi"}]


def _refused(e, param):
    """A 400 through the client whose error names `param`."""
    assert e.value.status_code == 400
    assert e.value.param == param, f"param {e.value.param!r}, expected {param!r}: {e.value.body}"
    assert e.value.type == "invalid_request_error", e.value.body
    return e.value.body


# ---------------------------------------------------------------------------------------------
# Validation: refused fields


# What the client sends for each OpenAI chat field the server does not implement.
CHAT_REFUSED = {
    "parallel_tool_calls": False,
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "logit_bias": {"50256": -100},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "Hello"},
    "store": True,
    "service_tier": "flex",
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "repetition_penalty": 1.2,
}

COMPLETION_REFUSED = {
    "echo": True,
    "suffix": " the end",
    "best_of": 3,
    "logit_bias": {"50256": -100},
    "repetition_penalty": 1.2,
}


@pytest.mark.parametrize("field", sorted(CHAT_REFUSED))
def test_chat_refuses_unsupported_field(client, model_id, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_id, messages=MSG, max_tokens=2, extra_body={field: CHAT_REFUSED[field]}
        )
    body = _refused(e, field)
    assert body["message"].startswith("not supported by this server"), body
    assert body["code"] == "unsupported_parameter", body


@pytest.mark.parametrize("field", sorted(COMPLETION_REFUSED))
def test_completion_refuses_unsupported_field(client, model_id, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="Hi", max_tokens=2, extra_body={field: COMPLETION_REFUSED[field]})
    body = _refused(e, field)
    assert body["message"].startswith("not supported by this server"), body


def test_unknown_fields_are_refused_by_name(client, model_id, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=MSG, max_tokens=2, extra_body={"temprature": 0.5})
    body = _refused(e, "temprature")
    assert body["message"] == "unknown field temprature" and body["code"] == "unknown_parameter", body
    # A chat field on the completions endpoint is unknown there.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_id, prompt="Hi", max_tokens=2, extra_body={"tools": []})
    _refused(e, "tools")
    # The server's own endpoints too.
    r = http.post("/tokenize", json={"content": "hi", "with_pieces": True})
    assert r.status_code == 400 and error_body(r)["param"] == "with_pieces", r.text
    ok_request(client, model_id)


def test_no_op_values_and_ignored_fields_are_accepted(client, model_id):
    r = client.chat.completions.create(
        model=model_id,
        messages=MSG,
        max_tokens=3,
        temperature=0,
        user="someone",
        metadata={"run": "test"},
        store=False,
        logit_bias={},
        tools=None,
        response_format={"type": "text"},
        extra_body={"safety_identifier": "hash", "prompt_cache_key": "k", "repetition_penalty": 1.0},
    )
    assert r.choices[0].finish_reason in ("stop", "length"), r
    r = client.completions.create(
        model=model_id, prompt="Hi", max_tokens=3, temperature=0, echo=False, best_of=1, user="someone"
    )
    assert r.choices[0].finish_reason in ("stop", "length"), r


# ---------------------------------------------------------------------------------------------
# Validation: messages and ranges


MESSAGE_CASES = {
    "user-without-content": ([{"role": "user"}], "messages[0].content"),
    "system-null-content": ([{"role": "system", "content": None}, *MSG], "messages[0].content"),
    "developer-without-content": ([{"role": "developer"}, *MSG], "messages[0].content"),
    "assistant-without-content": ([*MSG, {"role": "assistant"}, *MSG], "messages[1].content"),
    "tool-without-content": ([*MSG, {"role": "tool", "tool_call_id": "c"}], "messages[1].content"),
    "function-role": ([*MSG, {"role": "function", "content": "42", "name": "f"}], "messages[1].role"),
    "unknown-role": ([{"role": "narrator", "content": "Hi"}], "messages[0].role"),
    "refusal": ([*MSG, {"role": "assistant", "content": "no", "refusal": "no"}], "messages[1].refusal"),
    "unknown-message-field": ([{"role": "user", "content": "Hi", "mood": "happy"}], "messages[0].mood"),
    "image-part": (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        "messages[0].content[0].type",
    ),
    "empty-parts": ([{"role": "user", "content": []}], "messages[0].content"),
    "content-number": ([{"role": "user", "content": 5}], "messages[0].content"),
    "no-messages": ([], "messages"),
}


@pytest.mark.parametrize("case", sorted(MESSAGE_CASES))
def test_message_rules(client, model_id, case):
    messages, param = MESSAGE_CASES[case]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=messages, max_tokens=2)
    _refused(e, param)


RANGE_CASES = {
    "n-zero": ({"n": 0}, "n"),
    "n-negative": ({"n": -1}, "n"),
    "temperature-high": ({"temperature": 2.01}, "temperature"),
    "temperature-negative": ({"temperature": -0.5}, "temperature"),
    "top_p-high": ({"top_p": 1.5}, "top_p"),
    "top_p-negative": ({"top_p": -0.1}, "top_p"),
    "presence_penalty-high": ({"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty-low": ({"frequency_penalty": -2.5}, "frequency_penalty"),
    "max_tokens-zero": ({"max_tokens": 0}, "max_tokens"),
    "max_completion_tokens-zero": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "stop-five": ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "top_logprobs-without-logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs-high": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "stream_options-without-stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "max_tokens-string": ({"max_tokens": "ten"}, "max_tokens"),
    "seed-float": ({"seed": 1.5}, "seed"),
    "stop-number": ({"stop": 3}, "stop"),
}


@pytest.mark.parametrize("case", sorted(RANGE_CASES))
def test_range_rules(client, model_id, case):
    fields, param = RANGE_CASES[case]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id, messages=MSG, **({"max_tokens": 2} | fields))
    _refused(e, param)


def test_range_edges_are_accepted(client, model_id):
    # The closed ends of OpenAI's ranges, four stop strings, a negative seed.
    r = client.chat.completions.create(
        model=model_id,
        messages=MSG,
        max_tokens=2,
        temperature=2,
        top_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        stop=["a", "b", "c", "d"],
        seed=-7,
    )
    assert r.choices[0].finish_reason in ("stop", "length"), r


def test_top_p_zero_is_greedy(client, model_id):
    greedy = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=12, temperature=0)
    for seed in (1, 2):
        r = client.completions.create(model=model_id, prompt=PROMPTS[3], max_tokens=12, temperature=1.5, top_p=0, seed=seed)
        assert r.choices[0].text == greedy.choices[0].text, (r.choices[0].text, greedy.choices[0].text)


def test_developer_message_is_a_system_message(client, model_id):
    def answer(role):
        msgs = [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "What colour is the sky?"}]
        r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=12, temperature=0)
        return r.choices[0].message.content

    assert answer("developer") == answer("system")


def test_wrong_types_and_bodies_in_openai_shape(server, http):
    for body, param in [
        (b'{"prompt": "Hi", "max_tokens": ', None),
        (b"[1, 2, 3]", None),
        (b'{"prompt": {"text": "Hi"}}', "prompt"),
        (b'{"prompt": "Hi", "temperature": "warm"}', "temperature"),
    ]:
        r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = error_body(r)
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)


def test_listens_on_loopback_by_default(server):
    # MAIN_ARGS has no --host.
    assert urllib.parse.urlsplit(server.url).hostname == "127.0.0.1", server.url


# ---------------------------------------------------------------------------------------------
# Slow and vanished clients


def _raw_request(server, path, body, rcvbuf=None):
    """A POST on a bare socket, sent and not read (what a stalled client looks like)."""
    u = urllib.parse.urlsplit(server.url)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((u.hostname, u.port))
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    s.sendall(head.encode() + data)
    return s


def _idle_state(http):
    s = get_metrics(http)
    return {k: metric(s, k) for k in ("frugal_requests_running", "frugal_requests_waiting")}


def test_slow_reader_does_not_hold_the_scheduler(server, http, client, model_id):
    """A stream nobody reads still generates to its end (the scheduler never waits for a
    client), while other requests are served; its events wait for the reader, all of them.
    (On loopback the kernel buffers megabytes, so the server's writes may never block here;
    tests/scheduler.rs holds a reader that never reads against the scheduler itself.)"""
    before = get_metrics(http)
    base = metric(before, "frugal_requests_total", outcome="length")
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 150,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 5,
        "ignore_eos": True,
        "stream": True,
    }
    s = _raw_request(server, "/v1/chat/completions", body, rcvbuf=4096)
    try:
        # Served while the reader stalls.
        r = client.completions.create(model=model_id, prompt="Hello", max_tokens=2, temperature=0)
        want = 1 + (r.choices[0].finish_reason == "length")

        def finished():
            m = get_metrics(http)
            st = {"length_since": metric(m, "frugal_requests_total", outcome="length") - base, **_idle_state(http)}
            return st["length_since"] >= want and st["frugal_requests_running"] == 0, st

        _wait_for(finished, 240, "the unread stream generating to its end")
        s.settimeout(60)
        chunks = []
        while True:
            b = s.recv(1 << 16)
            if not b:
                break
            chunks.append(b)
            if b"data: [DONE]" in b"".join(chunks[-2:]):
                break
        data = b"".join(chunks)
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    assert b"data: [DONE]" in data[-200:], data[-300:]
    finishes = data.count(b'"finish_reason":"length"')
    assert finishes == 2, f"{finishes} choices finished"


def test_disconnect_non_stream_cancels(server, http, model_id):
    prompt = "1, 2, 3, 4, 5,"
    http.post("/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    before = get_metrics(http)
    base = metric(before, "frugal_requests_total", outcome="cancelled")
    body = {"model": model_id, "prompt": prompt, "max_tokens": 1800, "temperature": 0, "ignore_eos": True}
    s = _raw_request(server, "/v1/completions", body)
    _wait_for(lambda: (_idle_state(http)["frugal_requests_running"] == 1, _idle_state(http)), 30, "the request running")
    s.close()

    def settled():
        m = get_metrics(http)
        st = {"cancelled_since": metric(m, "frugal_requests_total", outcome="cancelled") - base, **_idle_state(http)}
        return st["cancelled_since"] == 1 and st["frugal_requests_running"] == 0, st

    _wait_for(settled, 10, "the closed non-streaming request cancelled")


# ---------------------------------------------------------------------------------------------
# Limits: a second server with keys, CORS, a small body limit and a short timeout


KEYS = ["sk-test-one", "sk-test-two"]
ORIGIN = "https://app.example"
TIMEOUT_S = 2
LIMIT_ARGS = [
    "--parallel", "1", "--ctx", "2048", "--kv-budget", "128MiB",
    "--api-key", KEYS[0], "--api-key", KEYS[1],
    "--cors-origin", ORIGIN,
    "--max-body-bytes", "4KiB",
    "--request-timeout", str(TIMEOUT_S),
    "--sse-keep-alive", "0.3",
]  # fmt: skip


@pytest.fixture(scope="module")
def guarded():
    s = Server(*LIMIT_ARGS, api_key=KEYS[0])
    yield s
    s.stop_and_check()


@pytest.fixture(scope="module")
def gmodel(guarded):
    with guarded.client() as c:
        return c.models.list().data[0].id


def test_api_key_required(guarded, gmodel):
    for key in KEYS:
        with guarded.client(api_key=key) as c:
            mid = c.models.list().data[0].id
            r = c.chat.completions.create(model=mid, messages=MSG, max_tokens=2)
            assert r.choices[0].finish_reason in ("stop", "length")
    with guarded.client(api_key="sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.chat.completions.create(model=gmodel, messages=MSG, max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key", e.value.body
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=gmodel, prompt="Hi", max_tokens=2)
    with httpx.Client(base_url=guarded.url, timeout=30) as h:
        for path in ("/v1/models", "/tokenize"):
            r = h.post(path, json={"content": "x"}) if path == "/tokenize" else h.get(path)
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert error_body(r)["code"] == "invalid_api_key"
            assert r.headers.get("www-authenticate") == "Bearer"
        # Probes stay open.
        for path in ("/health", "/livez", "/readyz", "/metrics"):
            assert h.get(path).status_code == 200, path


def test_api_key_from_environment():
    s = Server("--ctx", "512", "--kv-budget", "16MiB", env={"FRUGAL_API_KEY": "sk-env"}, api_key="sk-env")
    try:
        with s.client() as c:
            assert c.models.list().data
        with s.client(api_key="sk-other") as c:
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
    finally:
        s.stop_and_check()


def _preflight(h, origin):
    return h.request(
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang",
        },
    )


def test_cors(guarded, http):
    with httpx.Client(base_url=guarded.url, timeout=30) as h:
        r = _preflight(h, ORIGIN)
        assert r.status_code == 200, r.text
        assert r.headers.get("access-control-allow-origin") == ORIGIN, dict(r.headers)
        assert "authorization" in r.headers.get("access-control-allow-headers", ""), dict(r.headers)
        assert "POST" in r.headers.get("access-control-allow-methods", ""), dict(r.headers)
        r = _preflight(h, "https://evil.example")
        assert "access-control-allow-origin" not in r.headers, dict(r.headers)
        # An actual request from the page: allowed, and a refusal readable by it.
        r = h.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200 and r.headers.get("access-control-allow-origin") == ORIGIN
        r = h.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers.get("access-control-allow-origin") == ORIGIN
    # No --cors-origin: no CORS headers.
    r = _preflight(http, ORIGIN)
    assert "access-control-allow-origin" not in r.headers, dict(r.headers)


def test_body_too_large(guarded, gmodel):
    with guarded.client() as c:
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=gmodel, prompt="word " * 2000, max_tokens=2)
        assert e.value.status_code == 413, e.value
        err = error_body(e.value.response)
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error", err
        # Under the limit it is served.
        r = c.completions.create(model=gmodel, prompt="word " * 100, max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")


def _long_body(model, stream):
    # Hundreds of tokens, far more than TIMEOUT_S seconds of generation on any machine that
    # runs this suite: only the timeout can end it early.
    return dict(model=model, prompt="1, 2, 3, 4, 5,", max_tokens=1900, temperature=0,
                extra_body={"ignore_eos": True}, stream=stream)  # fmt: skip


def _generation_stopped(guarded, base_cancelled, base_length):
    with httpx.Client(base_url=guarded.url, timeout=30) as h:

        def settled():
            m = get_metrics(h)
            st = {
                "cancelled_since": metric(m, "frugal_requests_total", outcome="cancelled") - base_cancelled,
                "length_since": metric(m, "frugal_requests_total", outcome="length") - base_length,
                **_idle_state(h),
                "kv_blocks_used": metric(m, "frugal_kv_blocks_used"),
            }
            return st["cancelled_since"] == 1 and st["frugal_requests_running"] == 0, st

        st = _wait_for(settled, 10, "the timed-out request's generation stopped")
        assert st["length_since"] == 0, f"the generation ran to its end instead of stopping: {st}"


def _outcomes(guarded):
    with httpx.Client(base_url=guarded.url, timeout=30) as h:
        m = get_metrics(h)
    return metric(m, "frugal_requests_total", outcome="cancelled"), metric(m, "frugal_requests_total", outcome="length")


def test_timeout_non_stream(guarded, gmodel):
    base = _outcomes(guarded)
    with guarded.client() as c:
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(**_long_body(gmodel, False))
    assert e.value.status_code == 504, e.value
    err = error_body(e.value.response)
    assert err["type"] == "timeout_error" and err["code"] == "request_timeout", err
    assert e.value.response.headers.get("x-should-retry") == "false"
    _generation_stopped(guarded, *base)


def test_timeout_stream(guarded, gmodel):
    base = _outcomes(guarded)
    got = []
    with guarded.client() as c:
        with pytest.raises(openai.APIError) as e:
            for chunk in c.completions.create(**_long_body(gmodel, True)):
                got.append(chunk)
    assert got, "no token before the timeout"
    assert "--request-timeout" in str(e.value), e.value
    _generation_stopped(guarded, *base)


def test_sse_keep_alive_while_queued(guarded, gmodel):
    """With the only slot taken, a stream waits in the queue: comments keep it alive."""
    blocker_done = threading.Event()

    def blocker():
        try:
            with guarded.client() as c:
                c.completions.create(**_long_body(gmodel, False))
        except openai.InternalServerError:
            pass  # its timeout
        finally:
            blocker_done.set()

    t = threading.Thread(target=blocker)
    t.start()
    try:
        with httpx.Client(base_url=guarded.url, timeout=30, headers={"Authorization": f"Bearer {KEYS[0]}"}) as h:
            _wait_for(lambda: (_idle_state(h)["frugal_requests_running"] == 1, _idle_state(h)), 10, "the blocker running")
            body = {"model": gmodel, "prompt": "Hi", "max_tokens": 2, "stream": True}
            comments = 0
            with h.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith(":"):
                        comments += 1
                    if line.startswith("data:") or comments >= 2:
                        break
            assert comments >= 2, "no keep-alive comment while the stream waited for a slot"
    finally:
        t.join(60)
        assert blocker_done.is_set()
