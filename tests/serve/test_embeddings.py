"""`/v1/embeddings` through the official `openai` client (and raw HTTP where the client hides
the wire format): vector shape and norm, batches, token-id inputs, base64, `dimensions`, mean
and last pooling (a second server with `--pooling last`), and refusals.

Vectors are compared exactly where the server computes them the same way: the forward pass
gives each row the same bits alone or batched, chunked or not (8-bit activations, the server's
default), so an input embedded alone or in a batch, as text or as its token ids, gets the same
floats; and the JSON numbers are the shortest text that reads back as the same f32.

Run through tests/serve/run.sh (with test_openai.py, which holds the harness).
"""

import base64
import math
import struct
import threading

import openai
import pytest

from test_openai import Server, error_body, generate_reference, ok_request

TEXTS = [
    "The cat sat on the mat.",
    "Quantum chromodynamics describes the strong interaction.",
    "SELECT name FROM users WHERE id = 7",
]


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def f32(v):
    """Values rounded to f32, as the server computed them."""
    return list(struct.unpack(f"<{len(v)}f", struct.pack(f"<{len(v)}f", *v)))


def embed(client, model_id, inputs, **kw):
    return client.embeddings.create(model=model_id, input=inputs, encoding_format="float", **kw)


def _refused(e, param):
    assert e.value.status_code == 400, e.value.body
    assert e.value.param == param, f"param {e.value.param!r}, expected {param!r}: {e.value.body}"
    return e.value.body


@pytest.fixture(scope="module")
def width(client, model_id):
    return len(embed(client, model_id, "width").data[0].embedding)


@pytest.fixture(scope="module")
def last_server():
    s = Server("--pooling", "last", "--ctx", "512", "--kv-budget", "32MiB")
    yield s
    s.stop_and_check()


def test_single_string(client, http, model_id, width):
    r = embed(client, model_id, TEXTS[0])
    assert r.object == "list" and r.model == model_id
    assert len(r.data) == 1 and r.data[0].index == 0 and r.data[0].object == "embedding"
    v = r.data[0].embedding
    assert len(v) == width and all(isinstance(x, float) for x in v)
    assert abs(norm(v) - 1.0) < 1e-5
    # usage counts the tokens embedded: the text with the model's special tokens, as /tokenize.
    n = len(http.post("/tokenize", json={"content": TEXTS[0], "add_special": True}).json()["tokens"])
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n


def test_identical_inputs_give_identical_vectors_and_different_texts_differ(client, model_id):
    a = embed(client, model_id, TEXTS[0]).data[0].embedding
    b = embed(client, model_id, TEXTS[0]).data[0].embedding
    c = embed(client, model_id, TEXTS[1]).data[0].embedding
    assert a == b
    assert a != c
    cos = sum(x * y for x, y in zip(a, c))
    assert cos < 0.9999, cos


def test_batch_equals_singles(client, model_id):
    r = embed(client, model_id, TEXTS)
    assert [d.index for d in r.data] == [0, 1, 2]
    singles = [embed(client, model_id, t) for t in TEXTS]
    for d, s in zip(r.data, singles):
        # Exact: batching never changes a row's bits (see the module's doc).
        assert d.embedding == s.data[0].embedding
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_token_ids_equal_their_text(client, http, model_id):
    ids = [http.post("/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in TEXTS[:2]]
    one = embed(client, model_id, ids[0])
    assert one.data[0].embedding == embed(client, model_id, TEXTS[0]).data[0].embedding
    assert one.usage.prompt_tokens == len(ids[0])
    many = embed(client, model_id, ids)
    assert [d.embedding for d in many.data] == [embed(client, model_id, t).data[0].embedding for t in TEXTS[:2]]


def test_base64_equals_float(client, model_id, width):
    floats = embed(client, model_id, TEXTS).data
    raw = client.embeddings.create(model=model_id, input=TEXTS, encoding_format="base64").data
    for f, b in zip(floats, raw):
        assert isinstance(b.embedding, str)
        data = base64.b64decode(b.embedding)
        assert len(data) == 4 * width
        assert list(struct.unpack(f"<{width}f", data)) == f32(f.embedding)
    # Without encoding_format the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model=model_id, input=TEXTS[0]).data[0].embedding
    assert f32(default) == f32(floats[0].embedding)


def test_dimensions_shorten_and_renormalize(client, model_id, width):
    full = embed(client, model_id, TEXTS[1]).data[0].embedding
    short = embed(client, model_id, TEXTS[1], dimensions=64).data[0].embedding
    assert len(short) == 64
    assert abs(norm(short) - 1.0) < 1e-5
    n = norm(full[:64])
    assert max(abs(s - x / n) for s, x in zip(short, full[:64])) < 1e-6
    assert embed(client, model_id, TEXTS[1], dimensions=width).data[0].embedding == full
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, model_id, TEXTS[1], dimensions=width + 1)
    _refused(e, "dimensions")


def test_refusals_name_their_field(client, http, model_id):
    long_text = "hello " * 2300
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, model_id, long_text)
    body = _refused(e, "input")
    assert body["code"] == "context_length_exceeded", body
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, model_id, ["short", long_text])
    _refused(e, "input[1]")
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model_id, input="a", encoding_format="int8")
    _refused(e, "encoding_format")
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, model_id, "")
    _refused(e, "input")
    with pytest.raises(openai.BadRequestError) as e:
        embed(client, model_id, [[1, 2, 10**7]])
    _refused(e, "input[0]")
    with pytest.raises(openai.NotFoundError):
        embed(client, "no-such-model", "a")
    r = http.post("/v1/embeddings", json={"input": "a", "pooling": "cls"})
    assert r.status_code == 400 and error_body(r)["param"] == "pooling", r.text
    r = http.post("/v1/embeddings", json={"input": "a", "user": "u-1"})
    assert r.status_code == 200, r.text
    ok_request(client, model_id)


def test_last_pooling_differs_from_mean(client, model_id, last_server):
    with last_server.client() as lc:
        mean = embed(client, model_id, TEXTS[1]).data[0].embedding
        last = embed(lc, model_id, TEXTS[1]).data[0].embedding
        assert abs(norm(last) - 1.0) < 1e-5
        assert mean != last
        # One token: its mean is its last state.
        assert embed(client, model_id, [[42]]).data[0].embedding == embed(lc, model_id, [[42]]).data[0].embedding
        # Batches pool each input on its own.
        batch = embed(lc, model_id, TEXTS).data
        assert [d.embedding for d in batch] == [embed(lc, model_id, t).data[0].embedding for t in TEXTS]


def test_embeddings_beside_generation_change_no_tokens(client, model_id):
    """A long embedding input is prefilled in chunks beside a running greedy generation, which
    must produce exactly what `frugal generate` does alone."""
    prompt, n = "Once upon a time, in a small village,", 48
    want = generate_reference(prompt, n)["text"]
    out = {}

    def gen():
        r = client.completions.create(model=model_id, prompt=prompt, max_tokens=n, temperature=0)
        out["text"] = r.choices[0].text

    t = threading.Thread(target=gen)
    t.start()
    for _ in range(3):
        embed(client, model_id, ["lorem ipsum dolor " * 200, TEXTS[0]])
    t.join(300)
    assert out.get("text") == want
