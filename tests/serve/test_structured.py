"""Client-side tests of structured output (`response_format`) on the real model: every answer
must parse and validate against its schema (jsonschema), streamed or not, greedy or sampled.

Run through tests/serve/run.sh with the rest of the serve suite.
"""

import json

import jsonschema
import pytest

from test_openai import error_body

# Schemas whose every valid instance is short (bounded strings and arrays), so a generous
# max_tokens always lets the answer complete: finish_reason must be "stop".
SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"enum": ["low", "high"]},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "subtitle": {"type": "string", "maxLength": 30},
            "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 3,
        "maxItems": 3,
    },
}

PROMPTS = {
    "nested_object": "Give a person's name and address as JSON.",
    "array_bounds": "List some colors as JSON.",
    "enum": "Classify the sentiment of 'I love this!' as JSON.",
    "bounded_numbers": "Give an age and a score as JSON.",
    "optional_fields": "Describe a book as JSON.",
    "top_level_array": "Give three digits as a JSON array.",
}


def fmt(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat(client, model, prompt, **kw):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], **kw
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_answers_validate(client, model_id, name):
    schema = SCHEMAS[name]
    r = chat(client, model_id, PROMPTS[name], max_tokens=300, temperature=0,
             response_format=fmt(name, schema))
    c = r.choices[0]
    assert c.finish_reason == "stop", f"{name}: {c.finish_reason}: {c.message.content!r}"
    value = json.loads(c.message.content)
    jsonschema.validate(value, schema)
    # Constrained greedy decoding is deterministic.
    again = chat(client, model_id, PROMPTS[name], max_tokens=300, temperature=0,
                 response_format=fmt(name, schema))
    assert again.choices[0].message.content == c.message.content


def test_json_object_mode(client, model_id):
    r = chat(client, model_id, "Give me JSON.", max_tokens=400, temperature=0,
             response_format={"type": "json_object"})
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(json.loads(c.message.content), dict)


def test_text_format_is_unconstrained(client, model_id):
    plain = chat(client, model_id, "Say hello.", max_tokens=12, temperature=0)
    text = chat(client, model_id, "Say hello.", max_tokens=12, temperature=0,
                response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_sampled_choices_all_validate(client, model_id):
    schema = SCHEMAS["bounded_numbers"]
    r = chat(client, model_id, PROMPTS["bounded_numbers"], max_tokens=200, temperature=1.0,
             seed=7, n=4, response_format=fmt("n", schema))
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_streaming_with_a_schema(client, model_id):
    schema = SCHEMAS["nested_object"]
    kw = dict(max_tokens=300, temperature=0, response_format=fmt("s", schema))
    whole = chat(client, model_id, PROMPTS["nested_object"], **kw).choices[0].message.content
    parts, finish = [], None
    for chunk in chat(client, model_id, PROMPTS["nested_object"], stream=True, **kw):
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    text = "".join(parts)
    assert finish == "stop"
    assert text == whole
    jsonschema.validate(json.loads(text), schema)


def test_completions_endpoint(client, model_id, http):
    schema = SCHEMAS["enum"]
    r = client.completions.create(model=model_id, prompt="The review 'awful' as JSON:",
                                   max_tokens=100, temperature=0,
                                   extra_body={"response_format": fmt("c", schema)})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    # llama-server's bare `json_schema` field.
    r = http.post("/v1/completions", json={"prompt": "Three digits:", "max_tokens": 100,
                                            "temperature": 0,
                                            "json_schema": SCHEMAS["top_level_array"]})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMAS["top_level_array"])


def test_budget_running_out_mid_json_is_length(client, model_id):
    """Documented: the grammar does not shorten the answer, so a max_tokens too small for it
    ends the JSON unfinished, with finish_reason "length"."""
    r = chat(client, model_id, PROMPTS["nested_object"], max_tokens=4, temperature=0,
             response_format=fmt("x", SCHEMAS["nested_object"]))
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    "body,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format"),
        ({"json_schema": "not a schema"}, "json_schema"),
    ],
)
def test_invalid_formats_are_400(http, body, param):
    r = http.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert error_body(r)["param"] == param
