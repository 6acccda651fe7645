"""Canonical prompts: each API shape, and the prefix property the router depends on."""

import orjson
import pytest

from extproc.prompt import MAX_MESSAGES, NotRoutable, api_for_path, parse_request


def chat(messages, **extra):
    return orjson.dumps({"model": "m", "messages": messages, **extra})


def test_paths_map_to_apis():
    assert api_for_path("/v1/chat/completions") == "chat"
    assert api_for_path("/v1/chat/completions?x=1") == "chat"
    assert api_for_path("/v1/completions/") == "completions"
    assert api_for_path("/v1/responses") == "responses"
    assert api_for_path("/v1/models") is None
    assert api_for_path("") is None


def test_chat_earlier_turns_are_a_byte_prefix_of_later_turns():
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    turn1 = parse_request("chat", chat(history))
    history += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    turn2 = parse_request("chat", chat(history))
    assert turn2.prompt.startswith(turn1.prompt)
    assert turn1.first_turn_end == turn2.first_turn_end == len(turn1.prompt)


def test_the_preamble_ends_where_the_first_user_turn_starts():
    system = {"role": "system", "content": "You are terse."}
    user = {"role": "user", "content": "Hi"}
    plain = parse_request("chat", chat([system, user]))
    assert 0 < plain.preamble_end < plain.first_turn_end == len(plain.prompt)
    assert plain.prompt[: plain.preamble_end].endswith(b"You are terse.\x03")
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = parse_request("chat", chat([system, user], tools=tools))
    assert with_tools.preamble_end > plain.preamble_end  # the tool list is preamble too
    no_system = parse_request("chat", chat([user]))
    assert no_system.preamble_end == 0 and no_system.first_turn_end == len(no_system.prompt)
    assert parse_request("completions", orjson.dumps({"prompt": "x"})).preamble_end == 0


def test_chat_content_cannot_forge_message_boundaries():
    a = parse_request("chat", chat([{"role": "user", "content": "x\x03\x01user\x02y"}]))
    b = parse_request(
        "chat", chat([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    )
    assert a.prompt != b.prompt


def test_framing_bytes_are_escaped_in_whichever_message_holds_them():
    """One look at all the messages decides whether any needs escaping; then each that
    does is escaped, the others kept as they are (the bytes pinned)."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "plain"},
        {"role": "user", "content": "a\x1bb"},
        {"role": "critic\x02", "content": "c\x01d\x03"},
    ]
    assert parse_request("chat", chat(messages)).prompt == (
        b"\x01system\x02S\x03\x01user\x02plain\x03\x01user\x02a\x1b\x1bb\x03"
        b"\x01critic\x1bB\x02c\x1bAd\x1bC\x03"
    )
    clean = parse_request("chat", chat(messages[:2])).prompt
    assert clean == b"\x01system\x02S\x03\x01user\x02plain\x03"


def test_chat_multimodal_text_parts_and_images_are_hashed():
    parts = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": "http://img/1.png"}},
    ]
    other = [parts[0], {"type": "image_url", "image_url": {"url": "http://img/2.png"}}]
    a = parse_request("chat", chat([{"role": "user", "content": parts}]))
    b = parse_request("chat", chat([{"role": "user", "content": other}]))
    assert b"Describe" in a.prompt and b"1.png" in a.prompt
    assert a.prompt != b.prompt
    text_only = parse_request("chat", chat([{"role": "user", "content": "Describe"}]))
    assert text_only.prompt != a.prompt


def test_chat_tools_come_first_and_change_the_prompt():
    msgs = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    with_tools = parse_request("chat", chat(msgs, tools=tools))
    plain = parse_request("chat", chat(msgs))
    assert with_tools.prompt.startswith(b"\x01tools\x02")
    assert with_tools.prompt.endswith(plain.prompt)


def test_chat_tool_calls_and_tool_results_are_part_of_the_prompt():
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "1", "function": {"name": "f"}}],
    }
    result = {"role": "tool", "tool_call_id": "1", "content": "42"}
    req = parse_request("chat", chat([{"role": "user", "content": "q"}, call, result]))
    assert b'"tool_calls"' in req.prompt and b"42" in req.prompt


def test_model_and_salt_and_stream_are_read():
    req = parse_request(
        "chat", chat([{"role": "user", "content": "q"}], cache_salt="t1", stream=True)
    )
    assert (req.model, req.cache_salt, req.stream, req.api) == ("m", "t1", True, "chat")


def test_completions_string_batch_and_tokens():
    s = parse_request("completions", orjson.dumps({"model": "m", "prompt": "Once upon"}))
    assert s.prompt == b"Once upon" and s.first_turn_end == 0
    batch = parse_request("completions", orjson.dumps({"model": "m", "prompt": ["A", "B"]}))
    assert batch.prompt == b"A"
    toks = parse_request("completions", orjson.dumps({"model": "m", "prompt": [1, 2, 3]}))
    longer = parse_request("completions", orjson.dumps({"model": "m", "prompt": [1, 2, 3, 4]}))
    assert longer.prompt.startswith(toks.prompt)


def test_responses_instructions_and_input_items():
    body = {"model": "m", "instructions": "Be brief", "input": "Hello"}
    a = parse_request("responses", orjson.dumps(body))
    assert a.prompt.startswith(b"\x01system\x02Be brief\x03")
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
        {"type": "function_call", "name": "f", "arguments": "{}"},
    ]
    b = parse_request(
        "responses", orjson.dumps({"model": "m", "instructions": "Be brief", "input": items})
    )
    assert b.prompt.startswith(a.prompt)


@pytest.mark.parametrize(
    ("api", "body", "kind"),
    [
        ("chat", b"", "empty_body"),
        ("chat", b"{not json", "invalid_json"),
        ("chat", b"\xff\xfe", "invalid_json"),
        ("chat", b"[1,2]", "not_object"),
        ("chat", b'{"model":"m","messages":[]}', "no_prompt"),
        ("chat", b'{"model":"m"}', "no_prompt"),
        ("chat", b'{"model":1,"messages":[{"role":"user","content":"x"}]}', "bad_model"),
        ("chat", b'{"model":"m","messages":[{"role":"user","content":5}]}', "bad_content"),
        ("chat", b'{"model":"m","messages":[{"role":"user","content":{"a":1}}]}', "bad_content"),
        ("chat", b'{"model":"m","messages":["hi"]}', "bad_messages"),
        ("completions", b'{"model":"m","prompt":""}', "no_prompt"),
        ("completions", b'{"model":"m","prompt":[-1]}', "bad_prompt"),
        ("responses", b'{"model":"m","input":[]}', "no_prompt"),
    ],
)
def test_bad_bodies_are_not_routable_with_a_kind(api, body, kind):
    with pytest.raises(NotRoutable) as info:
        parse_request(api, body)
    assert info.value.kind == kind


def test_deeply_nested_json_is_not_routable():
    body = b'{"model":"m","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(NotRoutable):
        parse_request("chat", body)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_conversation_of_too_many_messages_is_not_routed(api):
    """Framing costs about 2 µs a message on the event loop whatever its size: past
    MAX_MESSAGES the request passes through (a 64 MiB body of empty messages took 65 s)."""
    key = "messages" if api == "chat" else "input"
    message = {"role": "user", "content": "x"}
    allowed = orjson.dumps({"model": "m", key: [message] * MAX_MESSAGES})
    assert parse_request(api, allowed).prompt
    too_many = orjson.dumps({"model": "m", key: [{}] * (MAX_MESSAGES + 1)})
    with pytest.raises(NotRoutable) as info:
        parse_request(api, too_many)
    assert info.value.kind == "too_many_messages"
