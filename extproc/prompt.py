"""OpenAI-style request body → the canonical prompt bytes a model server will see first.

The bytes need not equal the chat template's output; they must have the same prefix
structure: a conversation's earlier turns produce a byte prefix of its later turns, and two
requests that a model server would see with a shared prefix share a byte prefix here.
Each message is framed as ``\\x01role\\x02content\\x03`` with framing bytes inside it
escaped, so content cannot forge a boundary that shifts the following messages.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import orjson

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
_API_BY_PATH = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completions", RESPONSES_PATH: "responses"}
_PREAMBLE_ROLES = frozenset({"system", "developer"})
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


class NotRoutable(Exception):
    """The request is passed through with no decision; ``kind`` is a short, bounded label."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class LLMRequest:
    api: str
    model: str
    cache_salt: str
    prompt: bytes
    # Byte offset where the first user turn ends (0 when the API has no turns). Turns after
    # it change from request to request of one conversation, so cold-start placement keys
    # on the prefix up to here.
    first_turn_end: int
    stream: bool
    # Byte offset where the messages before the first user turn (system prompt, tools) end:
    # what every conversation of one application, or every question on one document, shares.
    preamble_end: int = 0
    # Requests the server's engine runs for it: ``n`` samples of each prompt of a batch
    # (vLLM counts each as a request of its own in its metrics: the traffic share compares).
    engine_requests: int = 1


def api_for_path(path: str) -> str | None:
    return _API_BY_PATH.get(path.split("?", 1)[0].rstrip("/") or "/")


# One request counts as at most this many of the server's (a client's n=10**9, which the
# server refuses, must not make this router read itself as placing all the traffic).
MAX_ENGINE_REQUESTS = 256
# Messages a conversation may have and still be routed (more pass through unrouted). Framing
# costs ~2-3 µs a message on the event loop whatever its size: a body within max_body_bytes of
# 22 million empty messages held a worker for 65 s (long enough to be killed as hung); the
# cap holds one request to ~0.3 s.
MAX_MESSAGES = 100_000

_FRAMING_BYTES = (b"\x1b", b"\x01", b"\x02", b"\x03")
# The usual roles' frame heads, built once (the escaping cannot change them).
_HEADS = {
    role: b"\x01" + role.encode() + b"\x02"
    for role in ("system", "developer", "user", "assistant", "tool", "function")
}


def _escape(data: bytes) -> bytes:
    """Escape the framing bytes (rare in real text, so usually four memchr scans)."""
    if any(b in data for b in _FRAMING_BYTES):
        data = data.replace(b"\x1b", b"\x1b\x1b")
        for b in _FRAMING_BYTES[1:]:
            data = data.replace(b, b"\x1b" + bytes([0x40 + b[0]]))
    return data


def _escape_each(contents: list[bytes]) -> list[bytes]:
    """``_escape`` of each: one look at them all first, as the framing bytes are rare and a
    long conversation's messages are many (a look each cost ~1 µs)."""
    joined = b"".join(contents)
    if any(b in joined for b in _FRAMING_BYTES):
        return [_escape(content) for content in contents]
    return contents


def frame_head(role: str) -> bytes:
    """What precedes a message's content in the canonical bytes (\\x01 role \\x02)."""
    head = _HEADS.get(role)
    return head if head is not None else b"\x01" + _escape(role.encode()) + b"\x02"


def _frame(role: str, content: bytes) -> bytes:
    return frame_head(role) + _escape(content) + b"\x03"


def canonical_conversation_start(messages: list[tuple[str, bytes]]) -> tuple[bytes, list[int]]:
    """The canonical bytes of a chat's start, as ``parse_request`` frames its messages
    (role, content), the last one left open (a model server's cached text may stop inside
    it: escaping is byte-local, so this is a byte prefix of the whole message's frame);
    and where each message's content begins in them."""
    chunks: list[bytes] = []
    starts: list[int] = []
    at = 0
    bodies = _escape_each([content for _, content in messages])
    for (role, _), body in zip(messages, bodies, strict=True):
        head = frame_head(role)
        starts.append(at + len(head))
        chunks += (head, body, b"\x03")
        at += len(head) + len(body) + 1
    if chunks:
        chunks.pop()  # the last message's end is not known
    return b"".join(chunks), starts


def _dump(value: Any) -> bytes:
    """Canonical bytes of a JSON value the body carried. orjson reads 1,024 levels of nesting
    and writes 254: a part nested deeper is bad content, not a failed stream (in full-duplex
    mode Envoy could only answer that with a 500)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:  # orjson.JSONEncodeError is one; too deep raises a plain one
        raise NotRoutable("bad_content", f"a value that cannot be re-encoded: {exc}") from None


def _part_bytes(part: Any) -> bytes:
    """Text parts as text; images, audio and files as opaque bytes of their reference."""
    if isinstance(part, str):
        return part.encode()
    if not isinstance(part, dict):
        raise NotRoutable("bad_content", f"content part of type {type(part).__name__}")
    kind = part.get("type")
    if kind in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
        return part["text"].encode()
    return b"\x04" + _dump(part) + b"\x05"


def _content_bytes(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, list):
        return b"".join(_part_bytes(part) for part in content)
    raise NotRoutable("bad_content", f"content of type {type(content).__name__}")


def _message_bytes(message: Any) -> tuple[str, bytes]:
    if type(message) is dict and len(message) == 2:  # most messages: a role and a text
        role, content = message.get("role"), message.get("content")
        if type(role) is str and type(content) is str:
            return role, content.encode()
    if not isinstance(message, dict):
        raise NotRoutable("bad_messages", "message is not an object")
    role = message.get("role", "user" if "content" in message else message.get("type", ""))
    if not isinstance(role, str):
        raise NotRoutable("bad_messages", "role is not a string")
    if "content" not in message and "type" in message:
        # Responses API items that are not messages (function_call, reasoning, ...).
        return role, _dump(message)
    body = _content_bytes(message.get("content"))
    extras = {k: message[k] for k in ("name", "tool_calls", "tool_call_id") if k in message}
    if extras:
        body += b"\x06" + _dump(extras)
    return role, body


def _conversation(preamble: list[bytes], messages: list[Any]) -> tuple[bytes, int, int]:
    if len(messages) > MAX_MESSAGES:
        raise NotRoutable("too_many_messages", f"{len(messages)} messages (over {MAX_MESSAGES})")
    parts = [_message_bytes(message) for message in messages]
    bodies = _escape_each([body for _, body in parts])
    framed = [
        frame_head(role) + body + b"\x03" for (role, _), body in zip(parts, bodies, strict=True)
    ]
    first_turn_end = preamble_end = 0
    first = next((k for k, (role, _) in enumerate(parts) if role not in _PREAMBLE_ROLES), None)
    if first is not None:
        preamble_end = sum(map(len, preamble)) + sum(map(len, framed[:first]))
        first_turn_end = preamble_end + len(framed[first])
    return b"".join(preamble + framed), first_turn_end, preamble_end


def _chat_prompt(body: dict[str, Any]) -> tuple[bytes, int, int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotRoutable("no_prompt", "messages missing or empty")
    preamble = []
    tools = body.get("tools")
    if tools:
        preamble.append(_frame("tools", _dump(tools)))
    return _conversation(preamble, messages)


def _token_bytes(tokens: list[Any]) -> bytes:
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise NotRoutable("bad_prompt", "token ids must be non-negative integers")
    return b"\x07" + array("I", tokens).tobytes()


def _completions_prompt(body: dict[str, Any]) -> tuple[bytes, int, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: route on its first prompt
    if isinstance(prompt, str) and prompt:
        return prompt.encode(), 0, 0
    if isinstance(prompt, list) and prompt:
        return _token_bytes(prompt), 0, 0
    raise NotRoutable("no_prompt", "prompt missing, empty or of an unknown shape")


def _responses_prompt(body: dict[str, Any]) -> tuple[bytes, int, int]:
    preamble = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        preamble.append(_frame("system", instructions.encode()))
    previous = body.get("previous_response_id")
    if isinstance(previous, str) and previous:
        preamble.append(_frame("previous", previous.encode()))
    items = body.get("input")
    if isinstance(items, str) and items:
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise NotRoutable("no_prompt", "input missing or empty")
    if body.get("tools"):
        preamble.insert(0, _frame("tools", _dump(body["tools"])))
    return _conversation(preamble, items)


_PROMPT_BUILDERS = {
    "chat": _chat_prompt,
    "completions": _completions_prompt,
    "responses": _responses_prompt,
}


def parse_request(api: str, body: bytes) -> LLMRequest:
    """Raise NotRoutable for anything that is not an LLM request we can place."""
    if not body:
        raise NotRoutable("empty_body")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise NotRoutable("invalid_json", str(exc)[:80]) from None
    if not isinstance(data, dict):
        raise NotRoutable("not_object")
    model = data.get("model", "")
    salt = data.get("cache_salt", "")
    if not isinstance(model, str) or not isinstance(salt, str):
        raise NotRoutable("bad_model", "model and cache_salt must be strings")
    prompt, first_turn_end, preamble_end = _PROMPT_BUILDERS[api](data)
    n = data.get("n", 1)
    samples = min(n, MAX_ENGINE_REQUESTS) if type(n) is int and n >= 1 else 1
    batch = data.get("prompt") if api == "completions" else None
    prompts = len(batch) if isinstance(batch, list) and isinstance(batch[0], str | list) else 1
    return LLMRequest(
        api=api,
        model=model,
        cache_salt=salt,
        prompt=prompt,
        first_turn_end=first_turn_end,
        stream=data.get("stream") is True,
        preamble_end=preamble_end,
        engine_requests=min(MAX_ENGINE_REQUESTS, samples * prompts),
    )
