"""Client-side tests of tool calling (`tools`, `tool_choice`) on the real model, served with
tests/serve/tools-template.jinja (a Qwen2.5 / Hermes-style template: SmolLM2's own has no tool
syntax). Forced calls (`required`, a named function) must validate against the function's
parameters; `auto` may or may not call, and must be well-formed either way.
"""

import json
import os

import jsonschema
import pytest

from test_openai import MAIN_ARGS, Server

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools-template.jinja")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tserver():
    s = Server(*MAIN_ARGS, "--chat-template", TEMPLATE)
    yield s
    s.stop_and_check()


@pytest.fixture(scope="module")
def tclient(tserver):
    c = tserver.client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def tmodel(tserver):
    with tserver.http() as h:
        return h.get("/v1/models").json()["data"][0]["id"]


def check_calls(choice, names=None):
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls", choice
    assert calls, choice
    for c in calls:
        assert c.type == "function" and c.id
        assert c.function.name in (names or PARAMS), c.function.name
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
    return calls


def test_required_calls_a_tool_with_valid_arguments(tclient, tmodel):
    r = tclient.chat.completions.create(model=tmodel, messages=ASK, tools=TOOLS,
                                        tool_choice="required", max_tokens=150, temperature=0)
    check_calls(r.choices[0])


def test_named_function_is_called(tclient, tmodel):
    r = tclient.chat.completions.create(
        model=tmodel, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = check_calls(r.choices[0], ["get_time"])
    assert [c.function.name for c in calls] == ["get_time"]


def test_none_gives_text(tclient, tmodel):
    r = tclient.chat.completions.create(model=tmodel, messages=ASK, tools=TOOLS,
                                        tool_choice="none", max_tokens=20, temperature=0)
    c = r.choices[0]
    assert not c.message.tool_calls
    assert c.finish_reason in ("stop", "length")
    assert isinstance(c.message.content, str) and c.message.content


def test_auto_is_well_formed(tclient, tmodel):
    r = tclient.chat.completions.create(model=tmodel, messages=ASK, tools=TOOLS,
                                        max_tokens=80, temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:
        check_calls(c)
    else:
        assert c.finish_reason in ("stop", "length")
        assert isinstance(c.message.content, str)


def test_sampled_required_calls_validate(tclient, tmodel):
    r = tclient.chat.completions.create(model=tmodel, messages=ASK, tools=TOOLS, n=3, seed=3,
                                        tool_choice="required", max_tokens=150, temperature=1.0)
    for c in r.choices:
        check_calls(c)


def test_streamed_tool_call_deltas_reassemble(tclient, tmodel):
    kw = dict(model=tmodel, messages=ASK, tools=TOOLS, tool_choice="required",
              max_tokens=150, temperature=0)
    whole = tclient.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls, finish = {}, None
    for chunk in tclient.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert c["id"] is None, "the id comes once, in the first delta"
                    c["id"] = d.id
                if d.function and d.function.name:
                    c["name"] += d.function.name
                if d.function and d.function.arguments:
                    c["arguments"] += d.function.arguments
    assert finish == "tool_calls"
    assert list(calls) == [0]
    c = calls[0]
    assert c["id"] and c["name"] == whole.function.name
    assert json.loads(c["arguments"]) == json.loads(whole.function.arguments)
    jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])


def test_tool_results_round_trip(tclient, tmodel):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    r = tclient.chat.completions.create(model=tmodel, messages=msgs, tools=TOOLS,
                                        tool_choice="none", max_tokens=30, temperature=0)
    c = r.choices[0]
    assert isinstance(c.message.content, str) and c.message.content
    assert c.finish_reason in ("stop", "length")
    # The conversation rendered: its tokens include the call and the result.
    assert r.usage.prompt_tokens > 60


@pytest.mark.parametrize(
    "tools,choice,param",
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "function"}], "auto", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "required", "tools"),
    ],
)
def test_bad_tools_are_400(tserver, tools, choice, param):
    with tserver.http() as h:
        r = h.post("/v1/chat/completions", json={"messages": ASK, "tools": tools,
                                                  "tool_choice": choice, "max_tokens": 5})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
