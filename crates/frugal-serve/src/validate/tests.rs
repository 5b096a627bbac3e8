use super::*;

fn chat_err(body: &str) -> ApiError {
    chat(body.as_bytes()).expect_err(body)
}

fn completion_err(body: &str) -> ApiError {
    completion(body.as_bytes()).expect_err(body)
}

fn param(e: &ApiError) -> &str {
    e.param.as_deref().unwrap_or("")
}

const HI: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

#[test]
fn honoured_fields_pass() {
    let c = chat(
        format!(
            r#"{{{HI},"model":"m","max_completion_tokens":5,"temperature":0.5,"top_p":0.9,"seed":-3,
            "stop":["a","b","c","d"],"n":2,"presence_penalty":-2,"frequency_penalty":2,"stream":true,
            "stream_options":{{"include_usage":true}},"logprobs":true,"top_logprobs":3,"user":"u",
            "metadata":{{"k":"v"}},"top_k":-1,"min_p":0.1,"ignore_eos":false,"min_tokens":1,
            "tools":null,"logit_bias":{{}},"store":false,"response_format":{{"type":"text"}}}}"#
        )
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(c.sampling.max_tokens, Some(5));
    assert_eq!(c.sampling.n, 2);
    assert!(c.sampling.include_usage && c.sampling.stream);
    assert_eq!(c.logprobs, Some(3));
    assert_eq!(c.messages[0]["role"], "user");
    let t = completion(
        br#"{"prompt":[1,2,3],"max_tokens":4,"logprobs":2,"echo":false,"best_of":1,"suffix":null,
            "repetition_penalty":1.0}"#,
    )
    .unwrap();
    assert_eq!(t.logprobs, Some(2));
    assert!(matches!(t.prompt, Prompt::Tokens(ref v) if v.len() == 3));
}

#[test]
fn every_unsupported_field_is_refused_by_name() {
    for u in CHAT_UNSUPPORTED {
        let e = chat_err(&format!(r#"{{{HI},"{}":{{"x":[1]}}}}"#, u.name));
        assert_eq!(param(&e), u.name, "{}", e.message);
        assert!(
            e.message.starts_with("not supported by this server"),
            "{}",
            e.message
        );
    }
    for u in COMPLETION_UNSUPPORTED {
        let e = completion_err(&format!(r#"{{"prompt":"hi","{}":{{"x":[1]}}}}"#, u.name));
        assert_eq!(param(&e), u.name, "{}", e.message);
    }
    for (name, value) in [
        ("echo", "true"),
        ("best_of", "2"),
        ("suffix", "\"end\""),
        ("repetition_penalty", "1.1"),
    ] {
        let e = completion_err(&format!(r#"{{"prompt":"hi","{name}":{value}}}"#));
        assert_eq!(param(&e), name, "{}", e.message);
    }
    for (name, value) in [
        ("parallel_tool_calls", "false"),
        ("store", "true"),
        ("logprobs", "\"yes\""),
    ] {
        let e = chat_err(&format!(r#"{{{HI},"{name}":{value}}}"#));
        assert_eq!(param(&e), name, "{}", e.message);
    }
}

#[test]
fn unknown_fields_are_refused_apart_from_unsupported_ones() {
    let e = chat_err(&format!(r#"{{{HI},"temprature":1}}"#));
    assert_eq!(param(&e), "temprature");
    assert_eq!(e.message, "unknown field temprature");
    // Chat-only and completions-only fields on the other endpoint.
    let e = completion_err(r#"{"prompt":"hi","messages":[]}"#);
    assert_eq!(param(&e), "messages");
    let e = completion_err(r#"{"prompt":"hi","tools":[]}"#);
    assert_eq!(e.message, "unknown field tools");
    let e = chat_err(&format!(r#"{{{HI},"echo":false}}"#));
    assert_eq!(param(&e), "echo");
    let e = chat_err(&format!(
        r#"{{{HI},"stream":true,"stream_options":{{"obfuscate":1}}}}"#
    ));
    assert!(param(&e).starts_with("stream_options"), "{e:?}");
}

#[test]
fn no_name_is_both_honoured_and_refused() {
    // Per endpoint: a name may be honoured on one and refused on another (`prompt`).
    let chat_fields = [fields::<ChatRequest>(), fields::<Common>()].concat();
    assert!(chat_fields.contains(&"messages") && chat_fields.contains(&"max_tokens"));
    let completion_fields = [fields::<CompletionRequest>(), fields::<Common>()].concat();
    let responses_fields = fields::<crate::api::ResponsesRequest>();
    assert!(responses_fields.contains(&"max_output_tokens"));
    for (honoured, refused) in [
        (&chat_fields[..], CHAT_UNSUPPORTED),
        (&completion_fields[..], COMPLETION_UNSUPPORTED),
        (fields::<EmbeddingRequest>(), EMBEDDING_UNSUPPORTED),
        (responses_fields, RESPONSES_UNSUPPORTED),
        (&[], MESSAGE_UNSUPPORTED),
    ] {
        for u in refused {
            assert!(
                !honoured.contains(&u.name),
                "{} is honoured and refused",
                u.name
            );
            assert!(
                !IGNORED.contains(&u.name),
                "{} is ignored and refused",
                u.name
            );
            for v in u.no_op {
                assert!(serde_json::from_str::<Value>(v).is_ok(), "{v}");
            }
        }
    }
}

#[test]
fn messages_need_content_and_a_known_role() {
    let e = chat_err(r#"{"messages":[{"role":"user"}]}"#);
    assert_eq!(param(&e), "messages[0].content");
    let e = chat_err(
        r#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":null}]}"#,
    );
    assert_eq!(param(&e), "messages[1].content");
    let e = chat_err(r#"{"messages":[{"role":"wizard","content":"a"}]}"#);
    assert_eq!(param(&e), "messages[0].role");
    let e = chat_err(r#"{"messages":[{"role":"tool","tool_call_id":"x"}]}"#);
    assert_eq!(param(&e), "messages[0].content");
    let e = chat_err(r#"{"messages":[{"role":"function","content":"a"}]}"#);
    assert_eq!(param(&e), "messages[0].role");
    let e = chat_err(r#"{"messages":[{"role":"assistant"}]}"#);
    assert_eq!(param(&e), "messages[0].content");
    let e = chat_err(r#"{"messages":[{"role":"user","content":"a","refusal":"no"}]}"#);
    assert_eq!(param(&e), "messages[0].refusal");
    let e = chat_err(r#"{"messages":[{"role":"user","content":"a","colour":"red"}]}"#);
    assert_eq!(e.message, "unknown field messages[0].colour");
    let e = chat_err(r#"{"messages":[{"role":"user","content":[]}]}"#);
    assert_eq!(param(&e), "messages[0].content");
    let e = chat_err(
        r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
    );
    assert_eq!(param(&e), "messages[0].content[0].type");
    let e = chat_err(r#"{"messages":[{"role":"user","content":[{"type":"text"}]}]}"#);
    assert_eq!(param(&e), "messages[0].content[0].text");
    let e = chat_err(r#"{"messages":[{"role":"user","content":5}]}"#);
    assert_eq!(param(&e), "messages[0].content");
    let e = chat_err(r#"{"messages":[]}"#);
    assert_eq!(param(&e), "messages");
    let e = chat_err(r#"{"model":"m"}"#);
    assert_eq!(param(&e), "messages");
    // A developer message is a system message to the template; null fields are absent.
    let c = chat(
        br#"{"messages":[{"role":"developer","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"name":null},
            {"role":"assistant","content":"ok","tool_calls":null,"refusal":null}]}"#,
    )
    .unwrap();
    let roles: Vec<_> = c
        .messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant"]);
    assert_eq!(c.messages[1]["content"], "ab");
    assert!(c.messages[2].get("tool_calls").is_none());
}

#[test]
fn ranges_follow_openai() {
    for (field, value) in [
        ("n", "0"),
        ("n", "17"),
        ("temperature", "2.5"),
        ("temperature", "-0.1"),
        ("top_p", "1.5"),
        ("top_p", "-0.5"),
        ("presence_penalty", "2.5"),
        ("frequency_penalty", "-3"),
        ("max_tokens", "0"),
        ("max_completion_tokens", "-1"),
        ("stop", r#"["a","b","c","d","e"]"#),
        ("stop", "7"),
        ("top_logprobs", "2"),
        ("stream_options", r#"{"include_usage":true}"#),
        ("min_tokens", "-1"),
        ("max_tokens", r#""ten""#),
        ("seed", "1.5"),
    ] {
        let e = chat_err(&format!(r#"{{{HI},"{field}":{value}}}"#));
        assert_eq!(param(&e), field, "{field}={value}: {}", e.message);
    }
    let e = chat_err(&format!(r#"{{{HI},"logprobs":true,"top_logprobs":21}}"#));
    assert_eq!(param(&e), "top_logprobs");
    let e = completion_err(r#"{"prompt":"hi","logprobs":6}"#);
    assert_eq!(param(&e), "logprobs");
    // top_p 0 is the most likely token alone; a negative seed is a seed.
    let c = chat(format!(r#"{{{HI},"top_p":0,"seed":-1}}"#).as_bytes()).unwrap();
    assert_eq!((c.sampling.params.top_k, c.sampling.params.top_p), (1, 1.0));
    assert_eq!(c.sampling.params.seed, u64::MAX);
}

#[test]
fn bodies_that_are_not_json_objects_are_named() {
    let e = completion_err(r#"{"prompt": "#);
    assert!(e.message.starts_with("malformed JSON"), "{}", e.message);
    let e = completion_err("[1, 2]");
    assert!(e.message.contains("JSON object"), "{}", e.message);
    let e = completion_err(r#"{"prompt": {"a": 1}}"#);
    assert_eq!(param(&e), "prompt");
    assert!(
        e.message.contains("a string, a list of strings"),
        "{}",
        e.message
    );
    let e =
        plain::<crate::api::TokenizeRequest>(br#"{"content":"a","with_pieces":true}"#).unwrap_err();
    assert_eq!(param(&e), "with_pieces");
}

fn embedding_err(body: &str) -> ApiError {
    embedding(body.as_bytes()).expect_err(body)
}

#[test]
fn embedding_inputs_take_every_openai_shape() {
    let e =
        embedding(br#"{"input":"hi","model":"m","encoding_format":"float","user":"u"}"#).unwrap();
    assert!(matches!(e.inputs, EmbeddingInputs::Texts(ref v) if v == &["hi"]));
    assert!(e.single && !e.base64 && e.dimensions.is_none());
    let e = embedding(br#"{"input":["a","b"],"encoding_format":"base64","dimensions":8}"#).unwrap();
    assert!(matches!(e.inputs, EmbeddingInputs::Texts(ref v) if v.len() == 2));
    assert!(!e.single && e.base64);
    assert_eq!(e.dimensions, Some(8));
    let e = embedding(br#"{"input":[1,2,3]}"#).unwrap();
    assert!(matches!(e.inputs, EmbeddingInputs::Tokens(ref v) if v == &[vec![1, 2, 3]]));
    assert!(e.single);
    let e =
        embedding(br#"{"input":[[1],[2,3]],"encoding_format":null,"dimensions":null}"#).unwrap();
    assert!(matches!(e.inputs, EmbeddingInputs::Tokens(ref v) if v.len() == 2));
    assert_eq!(input_param(e.single, 1), "input[1]");
}

#[test]
fn embedding_refusals_name_their_field() {
    for (body, want) in [
        (r#"{"model":"m"}"#, "input"),
        (r#"{"input":""}"#, "input"),
        (r#"{"input":[]}"#, "input"),
        (r#"{"input":[[]]}"#, "input[0]"),
        (r#"{"input":["a",""]}"#, "input[1]"),
        (r#"{"input":{"text":"a"}}"#, "input"),
        (r#"{"input":[-1]}"#, "input"),
        (
            r#"{"input":"a","encoding_format":"int8"}"#,
            "encoding_format",
        ),
        (r#"{"input":"a","encoding_format":1}"#, "encoding_format"),
        (r#"{"input":"a","dimensions":0}"#, "dimensions"),
        (r#"{"input":"a","dimensions":"all"}"#, "dimensions"),
        (r#"{"input":"a","pooling":"mean"}"#, "pooling"),
        (r#"{"input":"a","max_tokens":3}"#, "max_tokens"),
    ] {
        let e = embedding_err(body);
        assert_eq!(param(&e), want, "{body}: {}", e.message);
    }
    let many = format!(
        r#"{{"input":[{}]}}"#,
        vec!["\"a\""; MAX_EMBEDDING_INPUTS + 1].join(",")
    );
    assert_eq!(param(&embedding_err(&many)), "input");
}

fn responses_err(body: &str) -> ApiError {
    responses(body.as_bytes()).expect_err(body)
}

#[test]
fn responses_input_becomes_chat_messages() {
    let r = responses(
        br#"{"input":"hi","instructions":"be brief","max_output_tokens":16,"temperature":0,
            "top_p":0.5,"stream":true,"model":"m","metadata":{"k":"v"},"user":"u","store":false,
            "text":{"format":{"type":"text"}},"tool_choice":"none","reasoning":null,"truncation":"disabled"}"#,
    )
    .unwrap();
    let roles: Vec<_> = r.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user"]);
    assert_eq!(r.messages[0].content, "be brief");
    assert_eq!(r.sampling.max_tokens, Some(16));
    assert!(r.sampling.stream && r.sampling.n == 1);
    assert_eq!((r.temperature, r.top_p), (0.0, 0.5));
    assert_eq!(r.metadata["k"], "v");
    // Items: a developer message is a system message; an earlier response's output item (with
    // its id, status and annotations) is assistant history.
    let r = responses(
        br#"{"input":[{"role":"developer","content":"rules"},
            {"type":"message","role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]},
            {"type":"message","id":"msg_1","status":"completed","role":"assistant",
             "content":[{"type":"output_text","text":"ok","annotations":[]}]}]}"#,
    )
    .unwrap();
    let got: Vec<_> = r
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        got,
        [("system", "rules"), ("user", "ab"), ("assistant", "ok")]
    );
}

#[test]
fn responses_refusals_name_their_field() {
    for u in RESPONSES_UNSUPPORTED {
        let e = responses_err(&format!(r#"{{"input":"hi","{}":{{"x":[1]}}}}"#, u.name));
        assert_eq!(param(&e), u.name, "{}", e.message);
        assert_eq!(e.code, Some("unsupported_parameter"));
    }
    for (body, want) in [
        (r#"{"input":"hi","store":true}"#, "store"),
        (
            r#"{"input":"hi","previous_response_id":"resp_1"}"#,
            "previous_response_id",
        ),
        (
            r#"{"input":"hi","text":{"format":{"type":"json_object"}}}"#,
            "text",
        ),
        (
            r#"{"input":"hi","reasoning":{"effort":"low"}}"#,
            "reasoning",
        ),
        (
            r#"{"input":"hi","max_output_tokens":0}"#,
            "max_output_tokens",
        ),
        (r#"{"input":"hi","temperature":3}"#, "temperature"),
        (r#"{"input":"hi","max_tokens":3}"#, "max_tokens"),
        (r#"{"model":"m"}"#, "input"),
        (r#"{"input":[]}"#, "input"),
        (r#"{"input":5}"#, "input"),
        (r#"{"input":[{"role":"user"}]}"#, "input[0].content"),
        (r#"{"input":[{"content":"a"}]}"#, "input[0].role"),
        (
            r#"{"input":[{"role":"tool","content":"a"}]}"#,
            "input[0].role",
        ),
        (
            r#"{"input":[{"role":"user","content":"a","name":"b"}]}"#,
            "input[0].name",
        ),
        (
            r#"{"input":[{"type":"function_call_output","call_id":"c","output":"x"}]}"#,
            "input[0].type",
        ),
        (
            r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"x"}]}]}"#,
            "input[0].content[0].type",
        ),
        (
            r#"{"input":[{"role":"user","content":[{"type":"input_text"}]}]}"#,
            "input[0].content[0].text",
        ),
        (
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"a","annotations":[]}]}]}"#,
            "input[0].content[0].annotations",
        ),
    ] {
        let e = responses_err(body);
        assert_eq!(param(&e), want, "{body}: {}", e.message);
    }
}
