"""`/v1/responses` (OpenAI's Responses API, text in and out) through the official `openai`
client, and raw HTTP for the SSE framing: the response object, instructions, input as items,
`max_output_tokens` and `status: incomplete`, the streamed event sequence, and refusals of what
a stateless text server cannot do.

The greedy text must be what chat completions gives for the same messages: both go through the
chat template and the same scheduler.

Run through tests/serve/run.sh (with test_openai.py, which holds the harness).
"""

import json

import openai
import pytest

from test_openai import error_body, ok_request

Q = "What is the capital of France? Answer in one word."

# The events of one streamed text message, in order (deltas repeat).
SEQUENCE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def chat_text(client, model_id, messages, max_tokens):
    r = client.chat.completions.create(model=model_id, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0]


def test_text_in_text_out(client, model_id):
    r = client.responses.create(model=model_id, input=Q, max_output_tokens=64, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model_id
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    assert len(r.output) == 1
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_")
    assert [c.type for c in msg.content] == ["output_text"] and msg.content[0].annotations == []
    assert r.output_text.strip() and r.output_text == msg.content[0].text
    # The chat path: the same text and token counts as chat completions.
    c = chat_text(client, model_id, [{"role": "user", "content": Q}], 64)
    assert c.finish_reason == "stop"
    assert r.output_text == c.message.content
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0


def test_instructions_are_a_system_message(client, model_id):
    # (SmolLM2's template puts a default system message where none is given: the instructions
    # replace it.)
    instructions = "Answer only in French."
    plain = client.responses.create(model=model_id, input=Q, max_output_tokens=40, temperature=0)
    told = client.responses.create(
        model=model_id, input=Q, instructions=instructions, max_output_tokens=40, temperature=0
    )
    assert told.instructions == instructions
    assert told.output_text != plain.output_text
    assert told.usage.input_tokens != plain.usage.input_tokens
    c = chat_text(client, model_id, [{"role": "system", "content": instructions}, {"role": "user", "content": Q}], 40)
    assert told.output_text == c.message.content


def test_input_as_messages(client, model_id):
    items = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another one."}]},
    ]
    r = client.responses.create(model=model_id, input=items, max_output_tokens=12, temperature=0)
    chat = [{"role": "system" if m["role"] == "developer" else m["role"],
             "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in items]
    assert r.output_text == chat_text(client, model_id, chat, 12).message.content
    # A response's output sent back as history (stateless multi-turn).
    again = client.responses.create(
        model=model_id,
        input=[{"role": "user", "content": Q}, *[o.model_dump(exclude_none=True) for o in r.output],
               {"role": "user", "content": "And of Italy?"}],
        max_output_tokens=12,
        temperature=0,
    )
    assert again.status in ("completed", "incomplete") and again.output_text


def test_max_output_tokens_is_incomplete(client, model_id):
    r = client.responses.create(
        model=model_id, input="Write a long story about a dragon.", max_output_tokens=5, temperature=0
    )
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5


def _stream(client, model_id, **kw):
    with client.responses.create(model=model_id, stream=True, temperature=0, **kw) as s:
        return list(s)


def _check_sequence(events):
    types = [e.type for e in events]
    deltas = [i for i, t in enumerate(types) if t == "response.output_text.delta"]
    assert deltas, types
    collapsed = types[: deltas[0] + 1] + types[deltas[-1] + 1:]
    assert collapsed[:-1] == SEQUENCE, types
    assert types[deltas[0]: deltas[-1] + 1] == ["response.output_text.delta"] * len(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return "".join(events[i].delta for i in deltas)


def test_stream_events_in_order_and_complete(client, model_id):
    plain = client.responses.create(model=model_id, input=Q, max_output_tokens=64, temperature=0)
    assert plain.status == "completed"
    events = _stream(client, model_id, input=Q, max_output_tokens=64)
    text = _check_sequence(events)
    last = events[-1]
    assert last.type == "response.completed"
    assert last.response.status == "completed" and last.response.output_text == plain.output_text
    assert text == plain.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = [e for e in events if e.type == "response.output_text.done"][0]
    item = [e for e in events if e.type == "response.output_item.done"][0].item
    assert done.text == plain.output_text and done.item_id == item.id == last.response.output[0].id
    assert item.status == "completed" and item.content[0].text == plain.output_text
    assert last.response.usage.output_tokens == plain.usage.output_tokens


def test_stream_incomplete_ends_with_response_incomplete(client, model_id):
    events = _stream(client, model_id, input="Write a long story about a dragon.", max_output_tokens=6)
    _check_sequence(events)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"


def test_stream_sse_framing(server, model_id):
    """Raw SSE: every event has an `event:` line equal to its data's `type`; no `[DONE]`."""
    body = {"model": model_id, "input": "Hi", "max_output_tokens": 4, "temperature": 0, "stream": True}
    with server.http() as h, h.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers.get("content-type", "").startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert len(names) == len(datas) and names == [d["type"] for d in datas], lines
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")


def _refused(e, param):
    assert e.value.status_code == 400, e.value.body
    assert e.value.param == param, f"param {e.value.param!r}, expected {param!r}: {e.value.body}"
    return e.value.body


@pytest.mark.parametrize(
    "field,value",
    [
        ("store", True),
        ("previous_response_id", "resp_123"),
        ("tools", [{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
        ("tool_choice", "auto"),
        ("text", {"format": {"type": "json_object"}}),
        ("reasoning", {"effort": "low"}),
        ("background", True),
    ],
)
def test_refused_fields(client, model_id, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input="Hi", max_output_tokens=4, **{field: value})
    body = _refused(e, field)
    assert body.get("code") == "unsupported_parameter", body


def test_accepted_no_op_fields(client, model_id):
    r = client.responses.create(
        model=model_id, input="Hi", max_output_tokens=4, temperature=0, store=False,
        metadata={"k": "v"}, user="u-1", text={"format": {"type": "text"}}, tool_choice="none",
    )
    assert r.status in ("completed", "incomplete") and r.metadata == {"k": "v"}


def test_input_refusals(client, http, model_id):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=model_id, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]
        )
    _refused(e, "input[0].content[0].type")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input="hello " * 2300)
    _refused(e, "input")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_id, input="Hi", max_output_tokens=0)
    _refused(e, "max_output_tokens")
    r = http.post("/v1/responses", json={"input": "Hi", "max_tokens": 4})
    assert r.status_code == 400 and error_body(r)["param"] == "max_tokens", r.text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    ok_request(client, model_id)
