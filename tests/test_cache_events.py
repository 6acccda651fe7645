"""KV-cache events translated into the router's hashes (extproc/cache_events.py), and the
subscriber that feeds them to the router over a real ZMQ socket (extproc/cache_subscriber.py).

The tokeniser here is byte-level BPE without merges (one token per byte, the special tokens
whole): vLLM's real tokeniser, events and template are in tests/e2e/test_cache_events.py.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from pathlib import Path

import msgspec
import numpy as np
import orjson
import pytest
import zmq
import zmq.asyncio

from extproc import cache_events, cache_subscriber, model_fixture
from extproc.bench_events import stored_event
from extproc.cache_events import (
    ChatLayout,
    DatedLayouts,
    EndpointCacheEvents,
    TokenBytes,
    Translation,
    byte_level_alphabet,
    decode_message,
    template_environment,
)
from extproc.cache_subscriber import CacheEventSubscriber, publisher_address
from extproc.config import (
    CacheEventsConfig,
    ConfigError,
    EndpointConfig,
    RoutingConfig,
    load_config,
)
from extproc.hashing import block_hashes, root_hash
from extproc.model_fixture import BOS, CHAT_TEMPLATE, DATED_CHAT_TEMPLATE, SPECIAL_TOKENS
from extproc.prompt import parse_request
from extproc.router import Router
from extproc.serve import RouterService

MODEL = "tiny"
BLOCK = 64  # the router's block size in bytes
VLLM_BLOCK = 16  # tokens per vLLM block
BYTE_CHAR = byte_level_alphabet()
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
VOCAB.update({BYTE_CHAR[b]: len(SPECIAL_TOKENS) + b for b in range(256)})
SYSTEM = "You are a careful assistant. " * 10
QUESTION = "Explain é 中文 caches, and why blocks matter. " * 6
REPLY = "Caches keep attention state for reuse. " * 6


def _encode(text: str) -> list[int]:
    """Byte-level tokens of ``text``, the special tokens whole (as vLLM's tokeniser does)."""
    ids, at = [], 0
    while at < len(text):
        special = next((t for t in SPECIAL_TOKENS if text.startswith(t, at)), None)
        if special:
            ids.append(VOCAB[special])
            at += len(special)
        else:
            ids += [VOCAB[BYTE_CHAR[b]] for b in text[at].encode()]
            at += 1
    return ids


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = {
        "decoder": {"type": "ByteLevel"},
        "normalizer": None,
        "model": {"type": "BPE", "vocab": VOCAB},
        "added_tokens": [
            {"id": i, "content": t, "special": True} for i, t in enumerate(SPECIAL_TOKENS)
        ],
    }
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_bytes(orjson.dumps(spec))
    return path


@pytest.fixture(scope="module")
def translation(tokenizer_file: Path) -> Translation:
    layout = ChatLayout.from_template(CHAT_TEMPLATE, bos_token=BOS)
    return Translation(TokenBytes.from_file(tokenizer_file), layout, MODEL, BLOCK, 4096)


def _rendered(messages: list[dict[str, str]]) -> str:
    template = template_environment().from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=True, bos_token=BOS)


def _router_hashes(messages: list[dict[str, str]]) -> np.ndarray:
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    return block_hashes(parse_request("chat", body).prompt, root_hash(MODEL), BLOCK, 4096)


def _first_turn() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def _events_of(token_ids: list[int], prompt_blocks: int) -> list[dict[str, object]]:
    """vLLM's events for one request: the prompt's blocks in one BlockStored, then one per
    block of the reply as decoding fills it."""
    whole = len(token_ids) // VLLM_BLOCK
    return [stored_event(token_ids, 0, prompt_blocks, VLLM_BLOCK)] + [
        stored_event(token_ids, k, k + 1, VLLM_BLOCK) for k in range(prompt_blocks, whole)
    ]


def test_the_token_table_decodes_byte_for_byte(tokenizer_file: Path) -> None:
    text = _rendered(_first_turn()) + REPLY
    assert TokenBytes.from_file(tokenizer_file).decode(_encode(text)) == text.encode()


def test_a_stored_chain_translates_to_the_next_turns_router_hashes(
    translation: Translation,
) -> None:
    """The blocks vLLM computed for a first turn and its reply are, in the router's hashes,
    the first hashes of the conversation's next turn (what the router will look up)."""
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    token_ids = prompt + _encode(REPLY)
    table = EndpointCacheEvents(translation)
    announced = [
        h
        for _, hashes in table.apply(_events_of(token_ids, len(prompt) // VLLM_BLOCK))
        for h in hashes
    ]
    next_turn = [
        *messages,
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "More."},
    ]
    expected = _router_hashes(next_turn)
    prompt_only = _router_hashes(messages)
    assert table.untranslated == 0
    assert announced == expected[: len(announced)].tolist()
    # Extending a remembered chain (its text and last hash kept) gives what walking it does.
    walked = EndpointCacheEvents(translation, tip_bytes=0)
    events = _events_of(token_ids, len(prompt) // VLLM_BLOCK)
    assert [h for _, hashes in walked.apply(events) for h in hashes] == announced
    assert len(prompt_only) < len(announced) <= len(expected)  # the reply's blocks count
    # The chain's own prompt: the same hashes as the first turn's request, up to where the
    # generation prompt (template markup, not in the router's bytes) begins.
    assert announced[: len(prompt_only) - 1] == prompt_only[:-1].tolist()


def test_a_long_conversation_with_every_role_translates_exactly(
    translation: Translation,
) -> None:
    """Many messages (a segment and a separator search each: both now one sweep), a system
    message midway (a separator most messages never use), escaped content."""
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(60):
        role = "system" if k == 31 else ("user", "assistant")[k % 2]
        messages.append({"role": role, "content": f'Turn {k}: "quoted"\n\\ ' * (k % 5 + 1)})
    prompt = _encode(_rendered(messages))
    table = EndpointCacheEvents(translation)
    announced = [
        h for _, hs in table.apply(_events_of(prompt, len(prompt) // VLLM_BLOCK)) for h in hs
    ]
    expected = _router_hashes([*messages, {"role": "user", "content": "Next."}])
    assert table.untranslated == 0 and len(announced) > 60
    assert announced == expected[: len(announced)].tolist()
    assert len(expected) - len(announced) <= 3  # the generation prompt's markup, then "Next."
    # The same conversation a few turns at a time, as vLLM announces it: each turn's prompt
    # stores the blocks after the last whole block it found cached (its parent), then its
    # reply a block at a time. Extending a kept chain resumes its parse at the open message;
    # walking the chain (nothing kept) parses it all: both give the whole conversation.
    replies = [f"Reply {k}: " + REPLY for k in range(3)]
    for k, at in enumerate((21, 41)):
        messages[at] = {"role": "assistant", "content": replies[k]}
    turns = [messages[:21], messages[:41], messages]
    for tip_bytes in (cache_events.TIP_BYTES, 0):
        table, announced, cached = EndpointCacheEvents(translation, tip_bytes), [], 0
        for turn, reply in zip(turns, replies, strict=True):
            token_ids = _encode(_rendered(turn)) + _encode(reply)
            prompt_end = len(_encode(_rendered(turn))) // VLLM_BLOCK
            events = [stored_event(token_ids, cached, prompt_end, VLLM_BLOCK)] + [
                stored_event(token_ids, b, b + 1, VLLM_BLOCK)
                for b in range(prompt_end, len(token_ids) // VLLM_BLOCK)
            ]
            announced += [h for _, hs in table.apply(events) for h in hs]
            cached = len(token_ids) // VLLM_BLOCK
        expected = _router_hashes([*messages, {"role": "assistant", "content": replies[-1]}])
        assert table.untranslated == 0 and len(announced) >= len(expected) - 1 > 70
        assert announced == expected[: len(announced)].tolist()


def test_a_long_chain_applied_in_pieces_translates_as_it_does_whole(
    translation: Translation,
) -> None:
    """The subscriber applies a long stored chain in pieces (decisions run between them):
    the same router hashes, the same table, as the whole event; other events unsplit."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION * 8}]
    prompt = _encode(_rendered(messages))
    event = stored_event(prompt, 0, len(prompt) // VLLM_BLOCK, VLLM_BLOCK)
    event["extra_keys"] = [None] * len(event["block_hashes"])  # type: ignore[arg-type]
    other = {"type": "BlockRemoved", "block_hashes": [10**9]}
    parts = cache_events.in_pieces([other, event, "junk", other], piece_tokens=5 * VLLM_BLOCK)
    assert parts[0] == [other] and parts[-1] == ["junk", other] and len(parts) > 10
    pieces = [p for part in parts[1:-1] for p in part]
    assert [h for p in pieces for h in p["block_hashes"]] == event["block_hashes"]
    assert all(len(p["block_hashes"]) <= 5 for p in pieces)
    assert [p["parent_block_hash"] for p in pieces[1:]] == [
        p["block_hashes"][-1] for p in pieces[:-1]
    ]
    whole, in_parts = EndpointCacheEvents(translation), EndpointCacheEvents(translation)
    expected = [h for _, hs in whole.apply([event]) for h in hs]
    got = [h for part in parts for _, hs in in_parts.apply(part) for h in hs]
    assert got == expected and len(got) > 20 and in_parts.untranslated == 0
    assert len(in_parts) == len(whole)
    assert cache_events.in_pieces([event], piece_tokens=10**6) == [[event]]
    # Token ids of a shape it cannot slice: left whole (apply refuses it, the subscriber
    # counts it as malformed), never an error while splitting.
    odd = {**event, "token_ids": 7}
    assert cache_events.in_pieces([odd], piece_tokens=5 * VLLM_BLOCK) == [[odd]]
    # Many shorter chains in one message are parts of about piece_tokens too, in order.
    short = [stored_event(prompt, k, k + 2, VLLM_BLOCK) for k in range(0, 20, 2)]
    parts = cache_events.in_pieces(short, piece_tokens=5 * VLLM_BLOCK)
    assert [e for part in parts for e in part] == short
    assert len(parts) == 4 and all(len(part) <= 3 for part in parts)


def test_only_a_hybrid_models_full_attention_group_is_read(translation: Translation) -> None:
    """vLLM announces each KV-cache group's blocks under the same hashes with its group_idx
    (and the group's kind on stores). A sliding-window group frees a prompt's head early:
    its removals must not empty blocks the full-attention group still holds, nor its
    stores count twice. Events without a group (other vLLMs) are all read."""
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    event = stored_event(prompt, 0, len(prompt) // VLLM_BLOCK, VLLM_BLOCK)
    head = event["block_hashes"]  # the window group frees them all (the head first)
    full = {**event, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    window = {**event, "group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    table = EndpointCacheEvents(translation)
    stored = table.apply([window, full])
    assert len(stored) == 1 and stored[0][0] is True and len(stored[0][1]) > 3
    assert table.apply([{"type": "BlockRemoved", "block_hashes": head, "group_idx": 1}]) == []
    removed = table.apply([{"type": "BlockRemoved", "block_hashes": head, "group_idx": 0}])
    assert [held for held, _ in removed] == [False] and len(removed[0][1]) > 0
    # Full attention of another kind (gpt-oss's layers with sinks) is read all the same.
    sinks = EndpointCacheEvents(translation)
    stored = sinks.apply([window, {**full, "kv_cache_spec_kind": "sink_full_attention"}])
    assert [held for held, _ in stored] == [True]
    plain = EndpointCacheEvents(translation)  # no groups: as before
    assert plain.apply([event]) and plain.apply([{"type": "BlockRemoved", "block_hashes": head}])


def test_the_garbage_collector_stops_tracking_announced_blocks(translation: Translation) -> None:
    """A full collection walks every tracked object while decisions wait: an endpoint's
    table (up to a million blocks) must not be part of that walk."""
    import gc

    prompt = _encode(_rendered(_first_turn()))
    table = EndpointCacheEvents(translation)
    table.apply(_events_of(prompt, len(prompt) // VLLM_BLOCK))
    gc.collect()
    assert len(table) > 10 and not any(gc.is_tracked(b) for b in table._blocks.values())


def test_token_ids_the_vocabulary_lacks_decode_to_nothing() -> None:
    tokens = TokenBytes([b"a", b"b"])
    assert tokens.decode_blocks([0, 1, 1, 0], 2, 2) == [b"ab", b"ba"]
    assert tokens.decode_blocks([0, -1, 1, 5, 1], 2, 2) == [b"a", b"b"]  # -1 is not the last
    assert tokens.decode([]) == b"" and tokens.decode([7]) == b""


def test_removed_blocks_give_back_the_hashes_they_added(translation: Translation) -> None:
    prompt = _encode(_rendered(_first_turn()))
    token_ids = prompt + _encode(REPLY)
    table = EndpointCacheEvents(translation)
    announced = [
        h
        for _, hashes in table.apply(_events_of(token_ids, len(prompt) // VLLM_BLOCK))
        for h in hashes
    ]
    blocks = len(token_ids) // VLLM_BLOCK
    tail = table.apply([{"type": "BlockRemoved", "block_hashes": [blocks, blocks - 1]}])
    # Each block gave the router blocks that end inside its text: the first vLLM block
    # (the opening markup and 5 bytes of the system prompt) ends none of 64 bytes, the
    # first 21 vLLM blocks (336 tokens, one per byte here) end five.
    first = table.removed([1])
    next_twenty = table.removed(list(range(2, 22)))
    assert len(first) == 0 and next_twenty.tolist() == announced[:5]
    rest = table.removed(list(range(22, blocks - 1)))
    removed = [h for _, hashes in tail for h in hashes] + next_twenty.tolist() + rest.tolist()
    assert all(held is False for held, _ in tail)
    assert sorted(removed) == sorted(announced) and len(removed) == len(announced)
    assert len(table) == 0 and not len(table.removed([1]))  # unknown blocks: nothing
    # Past its cap the table forgets the longest-stored blocks (missed evictions).
    capped, full = (EndpointCacheEvents(translation, max_table_blocks=n) for n in (10, 10**6))
    for each in (capped, full):
        each.apply(_events_of(token_ids, len(prompt) // VLLM_BLOCK))
    assert len(capped) == 10 and len(full) == blocks
    assert capped.removed([blocks]).tolist() == full.removed([blocks]).tolist()
    assert not len(capped.removed([1])) and not len(capped.removed([blocks - 10]))


def test_what_cannot_be_translated_gives_nothing(translation: Translation) -> None:
    prompt = _encode(_rendered(_first_turn()))
    table = EndpointCacheEvents(translation)
    first = _events_of(prompt, len(prompt) // VLLM_BLOCK)[0]
    # An image's (id, offset) pair among the first block's extra keys: the tokens mean more
    # than their ids; and extra keys of a shape vLLM does not send.
    media = {**first, "extra_keys": [[["image-digest", 0]]] + [None] * 5}
    odd_keys = {**first, "extra_keys": ["salt"] + [None] * 5}
    orphan = {**first, "parent_block_hash": 999, "block_hashes": [1000]}
    offloaded = {**first, "medium": "CPU"}
    assert table.apply([media, odd_keys, orphan, offloaded, {"type": "Unknown"}, "junk"]) == []
    assert len(table) == 0
    assert table.apply([first]) and len(table) == len(first["block_hashes"])  # type: ignore[arg-type]


COMPLETION_TEXT = "Once upon a time a cache kept é 中文 blocks. " * 12
COMPLETION_REPLY = " Then the router found them again." * 8


def _completion_hashes(prompt: str) -> np.ndarray:
    body = json.dumps({"model": MODEL, "prompt": prompt}).encode()
    return block_hashes(parse_request("completions", body).prompt, root_hash(MODEL), BLOCK, 4096)


def _announced(table: EndpointCacheEvents, events: list[dict[str, object]]) -> list[int]:
    return [h for held, hashes in table.apply(events) if held for h in hashes]


def _with_post_processor(tokenizer_file: Path, processor: object, directory: Path) -> Translation:
    spec = orjson.loads(tokenizer_file.read_bytes())
    path = directory / "tokenizer.json"
    path.write_bytes(orjson.dumps({**spec, "post_processor": processor}))
    layout = ChatLayout.from_template(CHAT_TEMPLATE, bos_token=BOS)
    return Translation(TokenBytes.from_file(path), layout, MODEL, BLOCK, 4096)


def test_a_completions_prompt_translates_to_the_next_requests_router_hashes(
    translation: Translation,
) -> None:
    """A chain that is no chat of the template's is a completions prompt: its text is the
    router's bytes, so its blocks and its reply's are the next request's hashes (the
    context extended by the reply, as inference-perf's multi-turn completions send it)."""
    prompt = _encode(COMPLETION_TEXT)
    events = _events_of(prompt + _encode(COMPLETION_REPLY), len(prompt) // VLLM_BLOCK)
    table = EndpointCacheEvents(translation)
    announced = _announced(table, events)
    expected = _completion_hashes(COMPLETION_TEXT + COMPLETION_REPLY + " The end.")
    assert table.untranslated == 0
    assert announced == expected[: len(announced)].tolist()
    prompt_only = _completion_hashes(COMPLETION_TEXT)
    assert len(prompt_only) < len(announced)  # the reply's blocks count
    # Extending the kept chain (its parse resumed as a completion) gives what walking does,
    # and so do the pieces a long chain is applied in.
    walked = EndpointCacheEvents(translation, tip_bytes=0)
    assert _announced(walked, events) == announced
    pieces = EndpointCacheEvents(translation)
    split = [p for event in events for p in cache_events.in_pieces([event], 3 * VLLM_BLOCK)]
    assert len(split) > len(events)
    assert [h for part in split for h in _announced(pieces, part)] == announced
    # Evicted: the hashes it added come back.
    removed = table.apply([{"type": "BlockRemoved", "block_hashes": events[0]["block_hashes"]}])
    assert removed[0][0] is False and set(removed[0][1].tolist()) <= set(announced)


def test_a_completion_starts_after_the_special_tokens_the_tokeniser_puts_first(
    tokenizer_file: Path, tmp_path: Path
) -> None:
    """Llama 3's tokenizer.json puts <|begin_of_text|> before a text it encodes alone (a
    TemplateProcessing post-processor, in a Sequence after ByteLevel): vLLM's tokens of a
    completions prompt start with it, the router's bytes do not."""
    llama3 = {
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "trim_offsets": False},
            {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": BOS, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "pair": [],
                "special_tokens": {BOS: {"id": BOS, "ids": [VOCAB[BOS]], "tokens": [BOS]}},
            },
        ],
    }
    translation = _with_post_processor(tokenizer_file, llama3, tmp_path)
    assert translation.tokens.single_prefix == BOS.encode()
    prompt = [VOCAB[BOS], *_encode(COMPLETION_TEXT)]
    events = _events_of(prompt, len(prompt) // VLLM_BLOCK)
    table = EndpointCacheEvents(translation)
    announced = _announced(table, events)
    assert announced and table.untranslated == 0
    assert announced == _completion_hashes(COMPLETION_TEXT)[: len(announced)].tolist()
    # Without the BOS this tokeniser always adds, a chain is no completion of its own.
    bare = _encode(COMPLETION_TEXT)
    assert _announced(EndpointCacheEvents(translation), _events_of(bare, 4)) == []
    # A post-processor it cannot read: completions are not learnt, chats still are.
    unknown = _with_post_processor(tokenizer_file, {"type": "RobertaProcessing"}, tmp_path)
    assert unknown.tokens.single_prefix is None
    assert _announced(EndpointCacheEvents(unknown), _events_of(bare, 4)) == []
    chat = _encode(_rendered(_first_turn()))
    assert _announced(EndpointCacheEvents(unknown), _events_of(chat, len(chat) // VLLM_BLOCK))


def test_a_template_that_prints_the_date_is_read_on_every_day(tokenizer_file: Path) -> None:
    """Its start differs every day: the day's layout is learnt when the day comes, and a
    chain rendered the day before (announced after midnight) still reads. A layout learnt
    once, at start-up, reads nothing a week later."""
    clock = {"now": datetime.datetime(2026, 12, 4, 23, 59)}
    layouts = DatedLayouts(DATED_CHAT_TEMPLATE, BOS, clock=lambda: clock["now"])
    assert layouts.dated and not DatedLayouts(CHAT_TEMPLATE, BOS).dated
    translation = Translation(TokenBytes.from_file(tokenizer_file), layouts, MODEL, BLOCK, 4096)
    messages = _first_turn()
    expected = _router_hashes(
        [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "More."}]
    )

    def announced_on(day: datetime.datetime, table: EndpointCacheEvents) -> list[int]:
        render = template_environment(now=day).from_string(DATED_CHAT_TEMPLATE).render
        text = render(messages=messages, add_generation_prompt=True, bos_token=BOS)
        prompt = _encode(text)
        return _announced(table, _events_of(prompt + _encode(REPLY), len(prompt) // VLLM_BLOCK))

    clock["now"] = datetime.datetime(2026, 12, 5, 0, 1)
    for rendered in (datetime.datetime(2026, 12, 4, 23, 59), datetime.datetime(2026, 12, 5, 0, 1)):
        table = EndpointCacheEvents(translation)
        announced = announced_on(rendered, table)
        assert table.untranslated == 0 and len(announced) > 10
        assert announced == expected[: len(announced)].tolist()
    week_later = datetime.datetime(2026, 12, 12, 9, 0)
    clock["now"] = week_later
    assert announced_on(week_later, EndpointCacheEvents(translation))[:10] == expected[:10].tolist()
    once = ChatLayout.from_template(
        DATED_CHAT_TEMPLATE, BOS, now=datetime.datetime(2026, 12, 4, 12)
    )
    learnt_once = Translation(translation.tokens, once, MODEL, BLOCK, 4096)
    stale = EndpointCacheEvents(learnt_once)
    assert announced_on(week_later, stale)[:10] != expected[:10].tolist()
    # Only the neighbouring days are tried: three days back does not read as a chat.
    old = EndpointCacheEvents(translation)
    assert announced_on(datetime.datetime(2026, 12, 9, 9, 0), old)[:10] != expected[:10].tolist()


def _salted_next_turn(salt: str, model: str = MODEL) -> np.ndarray:
    messages = [*_first_turn(), {"role": "assistant", "content": REPLY}]
    messages.append({"role": "user", "content": "More."})
    body = json.dumps({"model": model, "messages": messages, "cache_salt": salt}).encode()
    request = parse_request("chat", body)
    return block_hashes(request.prompt, root_hash(model, salt), BLOCK, 4096)


def test_a_salted_or_lora_chain_translates_with_its_salt_and_adapter(
    translation: Translation,
) -> None:
    """vLLM hashes a salted prompt's first block with its ``cache_salt``, a LoRA request's
    every block with the adapter's name, and publishes both among the blocks' extra keys
    (untagged: the name first, the salt after it). The router roots a request's hashes in
    its model and salt, so both translate; the reply's blocks, which carry no salt, start
    from the chain's root (walked or kept)."""
    prompt = _encode(_rendered(_first_turn()))
    token_ids = prompt + _encode(REPLY)
    events = _events_of(token_ids, len(prompt) // VLLM_BLOCK)
    salted = [dict(e) for e in events]
    salted[0]["extra_keys"] = [["tenant-7"]] + [None] * (len(salted[0]["block_hashes"]) - 1)
    for tip_bytes in (cache_events.TIP_BYTES, 0):
        table = EndpointCacheEvents(translation, tip_bytes=tip_bytes)
        announced = _announced(table, salted)
        expected = _salted_next_turn("tenant-7")
        assert table.untranslated == 0 and len(announced) > len(prompt) * 4 // 5 // BLOCK
        assert announced == expected[: len(announced)].tolist()
        assert announced[:4] != _salted_next_turn("")[:4].tolist()  # not the unsalted chain
    # A LoRA adapter named in the event and in every block's keys, with a salt too.
    lora = [{**e, "lora_name": "adapter-a"} for e in events]
    for k, event in enumerate(lora):
        keys = [["adapter-a"] for _ in event["block_hashes"]]
        if k == 0:
            keys[0] = ["adapter-a", "tenant-7"]
        event["extra_keys"] = keys
    table = EndpointCacheEvents(translation, tip_bytes=0)
    announced = _announced(table, lora)
    assert table.untranslated == 0
    assert announced == _salted_next_turn("tenant-7", "adapter-a")[: len(announced)].tolist()
    # Evicting the salted chain's first block forgets its salt.
    table.apply([{"type": "BlockRemoved", "block_hashes": events[0]["block_hashes"]}])
    assert not table._salts


def test_a_day_whose_layout_cannot_be_learnt_keeps_start_ups(tokenizer_file: Path) -> None:
    """Learning a new day's layout happens while events are read: a template that fails on
    some day must not take the subscriber down. That day keeps the start-up layout."""
    picky = "{% if strftime_now('%d') == '13' %}{{ raise_exception('not today') }}{% endif %}"
    clock = {"now": datetime.datetime(2026, 12, 12, 9, 0)}
    layouts = DatedLayouts(picky + CHAT_TEMPLATE, BOS, clock=lambda: clock["now"])
    assert layouts.dated
    clock["now"] = datetime.datetime(2026, 12, 13, 9, 0)
    translation = Translation(TokenBytes.from_file(tokenizer_file), layouts, MODEL, BLOCK, 4096)
    table = EndpointCacheEvents(translation)
    prompt = _encode(_rendered(_first_turn()))
    announced = _announced(table, _events_of(prompt, len(prompt) // VLLM_BLOCK))
    assert announced == _router_hashes(_first_turn())[: len(announced)].tolist()
    assert layouts.for_day(clock["now"].date()) is layouts.today()


def test_a_cleared_cache_comes_in_order_with_what_was_stored_after_it(
    translation: Translation,
) -> None:
    prompt = _encode(_rendered(_first_turn()))
    events = _events_of(prompt, len(prompt) // VLLM_BLOCK)
    table = EndpointCacheEvents(translation)
    table.apply(events)
    changes = table.apply([{"type": "AllBlocksCleared"}, *events])
    assert changes[0][0] is None and [held for held, _ in changes[1:]] == [True]
    assert len(table) == len(events[0]["block_hashes"])  # type: ignore[arg-type]


def test_a_partial_tail_leaves_out_what_may_be_markup() -> None:
    layout = ChatLayout.from_template(CHAT_TEMPLATE, bos_token=BOS)
    text = _rendered([{"role": "user", "content": "Hi there"}]).encode() + b"Hello<|eo"
    spans = layout.split(text)
    assert spans is not None
    assert [(role, text[a:b]) for role, a, b in spans] == [
        ("user", b"Hi there"),
        ("assistant", b"Hello"),
    ]
    assert layout.split(b"no template here") is None
    assert layout.split(BOS.encode()) == []  # too short to tell the role: no content yet


def test_templates_and_tokenisers_it_cannot_invert_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be told apart"):
        ChatLayout.from_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match="does not compile"):
        ChatLayout.from_template("{% for m in messages %}")
    wordpiece = tmp_path / "tokenizer.json"
    wordpiece.write_bytes(orjson.dumps({"decoder": {"type": "WordPiece"}, "model": {}}))
    with pytest.raises(ValueError, match="only byte-level BPE and SentencePiece-style"):
        TokenBytes.from_file(wordpiece)
    unigram = tmp_path / "unigram.json"
    unigram.write_bytes(
        orjson.dumps({"decoder": {"type": "Metaspace"}, "model": {"type": "Unigram"}})
    )
    with pytest.raises(ValueError, match="'Unigram' model; only BPE"):
        TokenBytes.from_file(unigram)
    lowercase = tmp_path / "lowercase.json"
    spec = {"decoder": {"type": "ByteLevel"}, "model": {"vocab": {"a": 0}}}
    lowercase.write_bytes(orjson.dumps({**spec, "normalizer": {"type": "Lowercase"}}))
    with pytest.raises(ValueError, match=r"\['Lowercase'\] changes the text"):
        TokenBytes.from_file(lowercase)
    nfc = tmp_path / "nfc.json"  # Qwen's tokenizers: NFC text decodes as it was
    nfc.write_bytes(orjson.dumps({**spec, "normalizer": {"type": "NFC"}}))
    assert TokenBytes.from_file(nfc).decode([0]) == b"a"
    empty = tmp_path / "empty.json"  # a Sequence of no normalizers changes nothing
    empty.write_bytes(orjson.dumps({**spec, "normalizer": {"type": "Sequence", "normalizers": []}}))
    assert TokenBytes.from_file(empty).decode([0]) == b"a"


def test_malformed_messages_are_refused() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}], 0])
    assert decode_message([b"kv", (7).to_bytes(8, "big"), payload]) == (
        7,
        [{"type": "AllBlocksCleared"}],
    )
    for frames in ([b"kv"], [b"kv", b"\x00", payload], [b"kv", (1).to_bytes(8, "big"), b"\xc1"]):
        with pytest.raises(ValueError):
            decode_message(frames)
    with pytest.raises(ValueError):
        decode_message([b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode({"a": 1})])
    # ~5,000 levels of nesting in 5 KB: msgspec raises RecursionError, which ended the
    # endpoint's reading task for good; now it is a malformed message like the others.
    with pytest.raises(ValueError, match="nested"):
        decode_message([b"kv", (1).to_bytes(8, "big"), b"\x91" * 5000 + b"\xc0"])


async def test_a_fault_while_reading_an_endpoints_events_is_counted_and_reading_goes_on(
    translation: Translation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails while following a publisher is logged, counted and tried again; it
    used to end that endpoint's reading task silently (and make stop() raise)."""
    from extproc import cache_subscriber

    monkeypatch.setattr(cache_subscriber, "RETRY_SECONDS", 0.01)
    subscriber = CacheEventSubscriber(
        CacheEventsConfig(publisher="ipc:///x-{port}", topic="kv", model_dir="x", model=MODEL),
        translation,
        lambda: ["127.0.0.1:8001"],
        lambda endpoint, changes, replayed: {None, True, False},
    )
    calls = 0

    async def broken(endpoint: str) -> None:
        nonlocal calls
        calls += 1
        raise RecursionError("a fault")

    monkeypatch.setattr(subscriber, "_follow_publisher", broken)
    subscriber.start()
    for _ in range(200):
        if calls >= 3:
            break
        await asyncio.sleep(0.01)
    assert calls >= 3
    assert subscriber.counts["127.0.0.1:8001", "reader_errors"] >= 2
    await subscriber.stop()


def test_config_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cache_events: .*model_dir and model"):
        load_config(None, {"cache_events.publisher": "tcp://{host}:5557"}, environ={})
    with pytest.raises(ConfigError, match=r"cache_events\.publisher"):
        load_config(None, {"cache_events.publisher": "tcp://{address}:1"}, environ={})
    config = load_config(
        None,
        {
            "cache_events.publisher": "ipc:///x",
            "cache_events.model_dir": str(tmp_path),
            "cache_events.model": "m",
        },
        environ={},
    )
    with pytest.raises(ConfigError, match=r"cache_events\.model_dir"):
        cache_events.translation_from_config(config)
    assert publisher_address("tcp://{host}:5557", "[::1]:8000") == "tcp://[::1]:5557"
    assert (
        publisher_address("ipc:///run/kv-{port}.ipc", "10.0.0.7:8001") == "ipc:///run/kv-8001.ipc"
    )
    # Data-parallel ranks as endpoints of their own: API 8000 + rank, events 5557 + rank.
    assert publisher_address("tcp://{host}:{port-2443}", "10.0.0.7:8003") == "tcp://10.0.0.7:5560"
    assert publisher_address("tcp://{host}:{port+1}", "[::1]:8000") == "tcp://[::1]:8001"
    with pytest.raises(ConfigError, match=r"cache_events\.publisher.*\{port-N\}"):
        load_config(None, {"cache_events.publisher": "tcp://{host}:{port*2}"}, environ={})


def test_a_router_applies_an_endpoints_events_unless_it_places_nearly_all_traffic() -> None:
    endpoints = [EndpointConfig(address=a) for a in ("10.0.0.1:8000", "10.0.0.2:8000")]
    router = Router(RoutingConfig(), endpoints)
    hashes = _router_hashes(_first_turn())
    assert router.observe_cache_events("10.0.0.2:8000", [(True, hashes)])
    assert router.index.match(hashes, router.endpoints) == {"10.0.0.2:8000": len(hashes)}
    router._share_measured, router._traffic_share = True, 1.0  # it places all the traffic
    assert not router.observe_cache_events("10.0.0.1:8000", [(True, hashes)])
    assert router.index.match(hashes, router.endpoints) == {"10.0.0.2:8000": len(hashes)}
    router.observe_cache_events("10.0.0.2:8000", [(None, cache_events.EMPTY)])  # cleared: always
    assert router.index.match(hashes, router.endpoints) == {}


async def test_evictions_a_router_skips_are_counted_as_ignored(translation: Translation) -> None:
    """A router yet to measure its traffic share skips evictions (Router.observe_cache_events):
    the subscriber counts that message as ignored, not its blocks as removed; measured as one
    router of four, the same eviction is applied and counted."""
    endpoint = "127.0.0.1:8001"
    router = Router(RoutingConfig(block_size_bytes=BLOCK), [EndpointConfig(address=endpoint)])
    subscriber = CacheEventSubscriber(
        CacheEventsConfig(publisher="ipc:///x-{port}", topic="kv", model_dir="x", model=MODEL),
        translation,
        lambda: [endpoint],
        router.observe_cache_events,
    )
    subscriber.tables[endpoint] = EndpointCacheEvents(translation)
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    events = _events_of(prompt, len(prompt) // VLLM_BLOCK)
    hashes = _router_hashes(messages)
    removed = [{"type": "BlockRemoved", "block_hashes": events[0]["block_hashes"]}]

    async def publish(sequence: int, payload: list[dict[str, object]]) -> None:
        frames = [b"kv", sequence.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, payload, 0])]
        await subscriber.handle(endpoint, frames, sequence)

    def counts() -> dict[str, int]:
        return {kind: n for (_, kind), n in subscriber.counts.items()}

    await publish(0, events)
    assert counts()["stored_blocks"] >= len(hashes) - 1 and not counts().get("ignored_messages")
    stored = counts()["stored_blocks"]
    other = [{"role": "user", "content": "A question of another application. " * 12}]
    other_prompt = _encode(_rendered(other))
    other_events = _events_of(other_prompt, len(other_prompt) // VLLM_BLOCK)
    await publish(1, [*removed, *other_events])  # an eviction and another chain's blocks
    assert counts().get("removed_blocks", 0) == 0 and counts()["ignored_messages"] == 1
    assert counts()["stored_blocks"] > stored  # the stores of that message are counted
    assert router.index.match(hashes, [endpoint])[endpoint] >= len(hashes) - 1
    assert router.index.match(_router_hashes(other), [endpoint])
    router._share_measured, router._traffic_share = True, 0.25  # one router of four
    await publish(2, events)  # stored again, then evicted again
    await publish(3, removed)
    assert counts()["removed_blocks"] > 0 and counts()["ignored_messages"] == 1
    assert router.index.match(hashes, [endpoint]) == {}


async def test_the_subscriber_feeds_an_endpoints_published_events_to_the_router(
    tmp_path: Path, translation: Translation
) -> None:
    """A real ZMQ publisher per endpoint (ipc://, as vLLM binds it): what one endpoint
    publishes reaches the router's index for that endpoint only; a malformed message and a
    gap in the sequence are counted; a sequence starting over (a restarted publisher)
    empties the endpoint's index; a removed endpoint is no longer read."""
    endpoints = [EndpointConfig(address=a) for a in ("127.0.0.1:8001", "127.0.0.1:8002")]
    router = Router(RoutingConfig(block_size_bytes=BLOCK), endpoints)
    # One router of four (a router yet to measure its share would skip the evictions).
    router._share_measured, router._traffic_share = True, 0.25
    config = CacheEventsConfig(
        publisher=f"ipc://{tmp_path}/kv-{{port}}.ipc", topic="kv", model_dir="x", model=MODEL
    )
    addresses = [e.address for e in endpoints]
    subscriber = CacheEventSubscriber(
        config, translation, lambda: addresses, router.observe_cache_events
    )
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path}/kv-8002.ipc")
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    events = _events_of(prompt, len(prompt) // VLLM_BLOCK)
    hashes = _router_hashes(messages)

    def publish(sequence: int, payload: bytes) -> None:
        publisher.send_multipart([b"kv", sequence.to_bytes(8, "big"), payload])

    subscriber.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while not router.index.match(hashes, addresses):  # a SUB socket joins late: resend
            assert asyncio.get_running_loop().time() < deadline, subscriber.counts
            publish(0, msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}, *events], 0]))
            await asyncio.sleep(0.1)
        matched = router.index.match(hashes, addresses)
        assert set(matched) == {"127.0.0.1:8002"} and matched["127.0.0.1:8002"] >= len(hashes) - 1
        publish(1, b"\xc1")
        # Events of a shape it does not know (token ids that are not integers): counted, and
        # the messages after it are still read.
        odd = {**events[0], "token_ids": ["x", *events[0]["token_ids"][1:]]}
        publish(2, msgspec.msgpack.encode([0.0, [odd], 0]))
        publish(
            5,
            msgspec.msgpack.encode(
                [0.0, [{"type": "BlockRemoved", "block_hashes": events[0]["block_hashes"]}], 0]
            ),
        )
        while (
            router.index.match(hashes, addresses) != {}
            or not subscriber.counts["127.0.0.1:8002", "missed_messages"]
        ):
            assert asyncio.get_running_loop().time() < deadline, subscriber.counts
            await asyncio.sleep(0.05)
        counts = {
            kind: n
            for (endpoint, kind), n in subscriber.counts.items()
            if endpoint == "127.0.0.1:8002"
        }
        assert counts["malformed_messages"] == 2 and counts["missed_messages"] >= 2
        assert counts["stored_blocks"] >= len(hashes) - 1 and counts["removed_blocks"] > 0
        assert not any(endpoint == "127.0.0.1:8001" for endpoint, _ in subscriber.counts)
        # The sequence starting over means the publisher restarted: its cache is empty.
        publish(6, msgspec.msgpack.encode([0.0, events, 0]))
        while not router.index.match(hashes, addresses):
            assert asyncio.get_running_loop().time() < deadline, subscriber.counts
            await asyncio.sleep(0.05)
        restarts = subscriber.counts["127.0.0.1:8002", "restarts"]
        publish(0, msgspec.msgpack.encode([0.0, [], 0]))
        while router.index.match(hashes, addresses):
            assert asyncio.get_running_loop().time() < deadline, subscriber.counts
            await asyncio.sleep(0.05)
        assert subscriber.counts["127.0.0.1:8002", "restarts"] == restarts + 1
        addresses.remove("127.0.0.1:8002")
        subscriber.follow(addresses)
        assert set(subscriber.tables) == {"127.0.0.1:8001"}
    finally:
        await subscriber.stop()
        publisher.close(linger=0)
        context.term()


@pytest.mark.parametrize("shape", ["a backlog of messages", "one long chain"])
async def test_decisions_run_between_messages_and_between_pieces_of_one(
    translation: Translation, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """A ZMQ socket with messages waiting hands them over without yielding to the event
    loop, so the subscriber yields after each message, and after each piece of a long
    stored chain: a decision arriving during a backlog (a burst, a replay) or a long
    prompt's event waits for one piece's translation, not for all of it."""
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    payload = msgspec.msgpack.encode([0.0, _events_of(prompt, len(prompt) // VLLM_BLOCK), 0])
    count = 20 if shape == "a backlog of messages" else 1
    backlog = [[b"kv", k.to_bytes(8, "big"), payload] for k in range(count)]
    if shape == "one long chain":  # its ~600 tokens in pieces of 80
        monkeypatch.setattr(cache_subscriber, "PIECE_TOKENS", 5 * VLLM_BLOCK)

    class WaitingSocket:  # what zmq.asyncio returns while messages are queued: done futures
        def setsockopt(self, *_: object) -> None: ...
        def connect(self, _: str) -> None: ...
        def close(self, linger: int = 0) -> None: ...

        def recv_multipart(self) -> asyncio.Future[list[bytes]]:
            future = asyncio.get_running_loop().create_future()
            if backlog:
                future.set_result(backlog.pop(0))
            return future  # then nothing more: pending until the test stops it

    handled: list[int] = []
    subscriber = CacheEventSubscriber(
        CacheEventsConfig(publisher="ipc:///x-{port}", topic="kv", model_dir="x", model=MODEL),
        translation,
        lambda: ["127.0.0.1:8001"],
        lambda endpoint, changes, replayed: (
            handled.append(len(changes)) or {held for held, _ in changes}
        ),
    )
    monkeypatch.setattr(subscriber, "_socket", lambda kind, address: WaitingSocket())
    seen_by_a_decision: list[int] = []
    subscriber.start()
    try:
        for _ in range(300):
            seen_by_a_decision.append(len(handled))
            await asyncio.sleep(0)
    finally:
        await subscriber.stop()
    assert len(handled) >= 5 and subscriber.counts["127.0.0.1:8001", "untranslated_blocks"] == 0
    assert any(0 < n < len(handled) for n in seen_by_a_decision), seen_by_a_decision
    stored = subscriber.counts["127.0.0.1:8001", "stored_blocks"]
    assert stored == count * sum(
        len(h)
        for _, h in EndpointCacheEvents(translation).apply(
            _events_of(prompt, len(prompt) // VLLM_BLOCK)
        )
    )


async def test_a_late_subscriber_asks_the_replay_socket_for_what_it_missed(
    tmp_path: Path, translation: Translation
) -> None:
    """An endpoint's chain was published before the router subscribed; its extension comes
    live. The router asks the replay socket (served here as vLLM serves it: a ROUTER that
    sends every buffered message from the asked sequence, then an end marker) for the
    earlier messages, so the extension translates; without the replay socket it cannot
    (its parent is unknown) and the gap is counted. The buffer also holds another chain,
    stored and then evicted: the replay is the endpoint's history in order, so the router
    (yet to measure its traffic share, when it would skip a live eviction) applies both
    and does not take the endpoint for a holder of what it evicted."""
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    ids = prompt + _encode(REPLY)
    events = _events_of(ids, len(prompt) // VLLM_BLOCK)
    other = [{"role": "user", "content": "A question of another application. " * 12}]
    other_prompt = _encode(_rendered(other))
    # (its own vLLM block hashes: _events_of numbers a chain's blocks from 1)
    other_blocks = list(range(1001, 1001 + len(other_prompt) // VLLM_BLOCK))
    other_stored = [
        {
            **_events_of(other_prompt, len(other_blocks))[0],
            "block_hashes": other_blocks,
            "parent_block_hash": None,
        }
    ]
    other_evicted = [{"type": "BlockRemoved", "block_hashes": other_blocks}]
    history = [other_stored, *([event] for event in events[:-1]), other_evicted]
    buffered = [
        (seq, msgspec.msgpack.encode([0.0, payload, 0])) for seq, payload in enumerate(history)
    ]
    live = (len(buffered), msgspec.msgpack.encode([0.0, [events[-1]], 0]))
    next_turn = [
        *messages,
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "x"},
    ]
    whole = _router_hashes(next_turn)

    async def subscribe(replay: bool) -> tuple[Router, CacheEventSubscriber]:
        endpoints = [EndpointConfig(address="127.0.0.1:8002")]
        router = Router(RoutingConfig(block_size_bytes=BLOCK), endpoints)
        config = CacheEventsConfig(
            publisher=f"ipc://{tmp_path}/kv-{{port}}.ipc",
            replay=f"ipc://{tmp_path}/replay-{{port}}.ipc" if replay else "",
            model_dir="x",
            model=MODEL,
        )
        subscriber = CacheEventSubscriber(
            config, translation, lambda: ["127.0.0.1:8002"], router.observe_cache_events
        )
        subscriber.start()
        return router, subscriber

    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path}/kv-8002.ipc")
    replayer = context.socket(zmq.ROUTER)
    replayer.bind(f"ipc://{tmp_path}/replay-8002.ipc")

    async def serve_replays() -> None:
        while True:
            client, _, start = await replayer.recv_multipart()
            for seq, payload in buffered:
                if seq >= int.from_bytes(start, "big"):
                    await replayer.send_multipart(
                        [client, b"", b"", seq.to_bytes(8, "big"), payload]
                    )
            await replayer.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    server = asyncio.create_task(serve_replays())
    try:
        for replay in (False, True):
            router, subscriber = await subscribe(replay)
            try:
                counts = subscriber.counts
                deadline = asyncio.get_running_loop().time() + 10
                sequence = live[0]
                while (
                    not counts["127.0.0.1:8002", "untranslated_blocks"]
                    + counts["127.0.0.1:8002", "stored_blocks"]
                ):  # a SUB socket joins late: resend, numbered as the next message would be
                    assert asyncio.get_running_loop().time() < deadline, counts
                    await publisher.send_multipart([b"", sequence.to_bytes(8, "big"), live[1]])
                    sequence += 1
                    await asyncio.sleep(0.2)

                def matched_now(router: Router = router) -> int:
                    return router.index.match(whole, ["127.0.0.1:8002"]).get("127.0.0.1:8002", 0)

                while replay and matched_now() < len(whole) - 1:  # (the replay, then the live one)
                    assert asyncio.get_running_loop().time() < deadline, counts
                    await asyncio.sleep(0.05)
                assert not counts["127.0.0.1:8002", "restarts"]
                matched = matched_now()
                if replay:
                    assert counts["127.0.0.1:8002", "replayed_messages"] == len(buffered)
                    assert counts["127.0.0.1:8002", "untranslated_blocks"] == 0
                    assert matched >= len(whole) - 1, (matched, len(whole))
                    assert counts["127.0.0.1:8002", "removed_blocks"] > 0, dict(counts)
                    assert not counts["127.0.0.1:8002", "ignored_messages"]
                    assert router.index.match(_router_hashes(other), ["127.0.0.1:8002"]) == {}
                else:
                    assert counts["127.0.0.1:8002", "untranslated_blocks"] > 0 and matched == 0
            finally:
                await subscriber.stop()
    finally:
        server.cancel()
        publisher.close(linger=0)
        replayer.close(linger=0)
        context.term()


def test_bench_events_prints_and_writes_its_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from extproc import bench_events

    out = tmp_path / "events.json"
    for turns, backlog in ((1, 0), (6, 3)):
        args = argparse.Namespace(
            sizes="2",
            vllm_block=16,
            repeats=1,
            json_out=str(out),
            encode=False,
            turns=turns,
            backlog=backlog,
            gc_blocks=backlog * 100,
        )
        assert bench_events.run(args) == 0
        assert "| 2 |" in capsys.readouterr().out
        document = json.loads(out.read_text())
        row = document["rows"][0]
        assert row["router_blocks"] > 0 and row["table_bytes_per_block"] > 0
        assert row["messages"] == turns + 1
        # The backlog went through a real ZMQ socket and the subscriber, all of it.
        assert [(b["messages"], b["ticks"] > 0) for b in document["backlog"]] == (
            [(3, True)] if backlog else []
        )
        assert ("full_collection" in document) == bool(backlog)


def test_a_chain_that_starts_shorter_than_its_markup_still_translates_once_extended(
    translation: Translation,
) -> None:
    """A first block that ends inside the template's opening markup (the role not yet
    known) is remembered, so the blocks that extend it translate."""
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    table = EndpointCacheEvents(translation)
    head = 8  # BOS, the header token and "system": not yet a whole start
    assert translation.layout.split(translation.tokens.decode(prompt[:head])) == []
    short = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    assert table.apply([{**short, "token_ids": prompt[:head], "block_size": head}]) == []
    blocks = (len(prompt) - head) // VLLM_BLOCK
    rest = {
        "type": "BlockStored",
        "block_hashes": list(range(2, blocks + 2)),
        "parent_block_hash": 1,
        "token_ids": prompt[head : head + blocks * VLLM_BLOCK],
        "block_size": VLLM_BLOCK,
    }
    announced = [h for _, hashes in table.apply([rest]) for h in hashes]
    assert table.untranslated == 0
    assert announced and announced == _router_hashes(messages)[: len(announced)].tolist()


async def test_a_publisher_address_zmq_refuses_is_counted_not_fatal(
    translation: Translation,
) -> None:
    router = Router(RoutingConfig(), [EndpointConfig(address="127.0.0.1:8002")])
    config = CacheEventsConfig(
        publisher="ipc://" + "x" * 200 + "{port}", model_dir="x", model=MODEL
    )
    subscriber = CacheEventSubscriber(
        config, translation, lambda: ["127.0.0.1:8002"], router.observe_cache_events
    )
    subscriber.start()
    try:
        for _ in range(50):
            if subscriber.counts["127.0.0.1:8002", "socket_errors"]:
                break
            await asyncio.sleep(0.05)
        assert subscriber.counts["127.0.0.1:8002", "socket_errors"] == 1
    finally:
        await subscriber.stop()


def test_config_check_and_serve_refuse_model_files_the_translation_cannot_use(
    tmp_path: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`prefix-router config --check` and `serve` load the tokeniser and chat template at
    start-up: a directory without them is refused with the field named, before serving."""
    from extproc import cli

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = tmp_path / "router.yaml"
    config.write_text(
        "endpoints: [127.0.0.1:1]\ncache_events:\n  publisher: ipc:///tmp/x-{port}.ipc\n"
        f"  model_dir: {model_dir}\n  model: tiny\n"
    )
    for argv in (["config", "--check", str(config)], ["serve", "--config", str(config)]):
        assert cli.main(argv) == 2
        assert "cache_events.model_dir" in capsys.readouterr().err
    (model_dir / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": BOS})
    )
    assert cli.main(["config", "--check", str(config)]) == 0
    err = capsys.readouterr().err  # what was read, for the operator to check
    assert "cache_events: byte-level BPE, 262 tokens" in err, err
    assert "first messages system/user/assistant" in err
    # serve loads the translation once: the check's is the one the subscriber gets.
    from extproc import serve

    loaded: list[Translation] = []
    served: list[Translation | None] = []

    def counted(*args: object) -> Translation:
        loaded.append(load(*args))  # type: ignore[arg-type]
        return loaded[-1]

    async def run(config: object, translation: Translation | None = None) -> None:
        served.append(translation)

    load = cache_events.load_translation
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_events, "load_translation", counted)
        patch.setattr(serve, "serve_until_signalled", run)
        assert cli.main(["serve", "--config", str(config)]) == 0
    assert len(loaded) == 1 and served == loaded
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    )
    assert cli.main(["config", "--check", str(config)]) == 2
    assert "cannot be told apart" in capsys.readouterr().err


def test_the_conversation_start_is_a_prefix_of_the_requests_bytes_escaping_included() -> None:
    from extproc.prompt import canonical_conversation_start

    messages = [("system", "frame \x01 bytes \x03 inside"), ("user", "and a question")]
    body = {"model": MODEL, "messages": [{"role": r, "content": c} for r, c in messages]}
    whole = parse_request("chat", json.dumps(body).encode()).prompt
    start, content_starts = canonical_conversation_start([(r, c.encode()) for r, c in messages])
    assert whole.startswith(start) and len(whole) == len(start) + 1  # only the last \x03
    assert whole[content_starts[1] :].startswith(b"and a question")
    assert content_starts[0] == len(b"\x01system\x02")


# -- SentencePiece-style tokenisers (Llama 2, Mistral, Phi-3) ------------------------------
# One piece per character, "▁" for a space (and "▁x" for a space and a character, as the
# real ones merge them), <0xNN> byte pieces for what is not ASCII, [INST] and [/INST] whole:
# real vLLM with the fixture's trained tokeniser is tests/e2e/test_cache_events.py's.
SP_ADDED = model_fixture.SP_SPECIAL_TOKENS
SP_PIECES = [
    *SP_ADDED,
    *(f"<0x{b:02X}>" for b in range(256)),
    "▁",
    *(chr(c) for c in range(0x21, 0x7F)),
    *("▁" + chr(c) for c in range(0x21, 0x7F)),
]
SP_VOCAB = {piece: i for i, piece in enumerate(SP_PIECES)}
SP_BOS_ID = SP_VOCAB[model_fixture.SP_BOS]


def _sp_spec(normalizer: object = None, pre: object = "first") -> dict[str, object]:
    return {
        "normalizer": normalizer,
        "pre_tokenizer": None
        if pre is None
        else {"type": "Metaspace", "replacement": "▁", "prepend_scheme": pre, "split": False},
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {"type": "BPE", "byte_fallback": True, "vocab": SP_VOCAB},
        "added_tokens": [{"id": i, "content": t, "special": True} for i, t in enumerate(SP_ADDED)],
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A"}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [SP_BOS_ID]}},
        },
    }


def _sp_encode(text: str, prepend: str) -> list[int]:
    """``text`` as a SentencePiece-style tokeniser with ``prepend`` encodes it: split at the
    added tokens, a "▁" put before each piece as the scheme says, spaces as "▁"."""
    ids: list[int] = []
    at = 0
    while at < len(text):
        added = next((t for t in SP_ADDED if text.startswith(t, at)), None)
        if added:
            ids.append(SP_VOCAB[added])
            at += len(added)
            continue
        end = min([len(text)] + [k for t in SP_ADDED if (k := text.find(t, at)) >= 0])
        piece = text[at:end]
        if prepend == "every" or (
            not piece.startswith(" ") and (prepend == "always" or (prepend == "first" and at == 0))
        ):
            piece = " " + piece
        ids += _sp_pieces(piece.replace(" ", "▁"))
        at = end
    return ids


def _sp_pieces(piece: str) -> list[int]:
    ids, k = [], 0
    while k < len(piece):
        pair = piece[k : k + 2]
        if pair in SP_VOCAB and len(pair) == 2:
            ids.append(SP_VOCAB[pair])
            k += 2
        elif piece[k] in SP_VOCAB:
            ids.append(SP_VOCAB[piece[k]])
            k += 1
        else:
            ids += [SP_VOCAB[f"<0x{b:02X}>"] for b in piece[k].encode()]
            k += 1
    return ids


SP_CASES = [  # (tokenizer.json's normaliser, pre-tokeniser, tokenizer_config.json) -> prepend
    (None, "first", {"tokenizer_class": "LlamaTokenizer"}, "first"),
    (None, "first", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True}, "always"),
    (None, "always", {"tokenizer_class": "LlamaTokenizer", "legacy": False}, "first"),
    (None, "first", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}, "never"),
    (None, "first", {"tokenizer_class": "GemmaTokenizer", "legacy": True}, "never"),
    (None, "always", {"tokenizer_class": "PreTrainedTokenizerFast"}, "always"),
    (None, None, {}, "never"),
    (
        {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        None,
        {},
        "every",
    ),
]


def _sp_tokens(tmp_path: Path, normalizer: object, pre: object, config: dict) -> TokenBytes:
    path = tmp_path / "sp.json"
    path.write_bytes(orjson.dumps(_sp_spec(normalizer, pre)))
    return TokenBytes.from_file(path, config)


def _sp_table(tokens: TokenBytes) -> EndpointCacheEvents:
    """A table translating the fixture's SentencePiece template, spelt as ``tokens`` do."""
    layout = ChatLayout.from_template(
        model_fixture.SP_CHAT_TEMPLATE,
        model_fixture.SP_BOS,
        model_fixture.SP_EOS,
        tokenized=tokens.as_tokenized,
    )
    return EndpointCacheEvents(Translation(tokens, layout, MODEL, BLOCK, 4096))


@pytest.mark.parametrize(("normalizer", "pre", "config", "prepend"), SP_CASES)
def test_a_sentencepiece_tokeniser_is_read_as_transformers_loads_it(
    tmp_path: Path, normalizer: object, pre: object, config: dict, prepend: str
) -> None:
    tokens = _sp_tokens(tmp_path, normalizer, pre, config)
    assert tokens.prepend == prepend and tokens.sentencepiece
    assert tokens.single_prefix == b"<s>"
    layout = ChatLayout.from_template(model_fixture.SP_CHAT_TEMPLATE, "<s>", "</s>")
    described = Translation(tokens, layout, MODEL, BLOCK, 4096).describe()
    assert described.startswith(f"SentencePiece-style BPE, {len(SP_PIECES)} tokens, ")
    assert "completions after b'<s>'" in described
    text = "<s><<SYS>>\nBe brief é.[INST] Why  中文? [/INST]"
    spelt = tokens.as_tokenized(text)
    assert tokens.decode(_sp_encode(text, prepend)) == spelt.encode()
    expected = {
        "never": text,
        "first": text,  # the text starts with an added token: no piece at its start
        "always": "<s> <<SYS>>\nBe brief é.[INST] Why  中文? [/INST]",
        "every": "<s> <<SYS>>\nBe brief é.[INST]  Why  中文? [/INST]",
    }[prepend]
    assert spelt == expected
    assert tokens.as_tokenized("plain") == ("plain" if prepend == "never" else " plain")
    assert tokens.as_tokenized(" x") == (" x" if prepend != "every" else "  x")


def test_sentencepiece_tokenisers_it_does_not_follow_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="class 'T5Tokenizer'"):
        _sp_tokens(tmp_path, None, "first", {"tokenizer_class": "T5Tokenizer"})
    with pytest.raises(ValueError, match=r"normalizer \['NFKC'\]"):
        _sp_tokens(tmp_path, {"type": "NFKC"}, None, {})
    with pytest.raises(ValueError, match="prepend_scheme 'sometimes'"):
        _sp_tokens(tmp_path, None, "sometimes", {})


@pytest.mark.parametrize(("normalizer", "pre", "config", "prepend"), SP_CASES)
def test_a_sentencepiece_chat_translates_to_the_next_turns_router_hashes(
    tmp_path: Path, normalizer: object, pre: object, config: dict, prepend: str
) -> None:
    """vLLM renders the template, encodes it without special tokens added, generates a
    reply after it: each scheme's tokens translate into the next turn's router hashes."""
    table = _sp_table(_sp_tokens(tmp_path, normalizer, pre, config))
    template = model_fixture.SP_CHAT_TEMPLATE
    messages = _first_turn()
    following = [*messages, {"role": "assistant", "content": REPLY}]

    def encoded(conversation: list[dict[str, str]]) -> list[int]:
        rendered = (
            template_environment()
            .from_string(template)
            .render(
                messages=conversation,
                bos_token=model_fixture.SP_BOS,
                eos_token=model_fixture.SP_EOS,
            )
        )
        return _sp_encode(rendered, prepend)

    # The reply generated after [/INST] as the template spells it in the next turn (a
    # trained model's habit), its </s> not yet.
    prompt_ids, ids = encoded(messages), encoded(following)[:-1]
    assert ids[: len(prompt_ids)] == prompt_ids
    events = _events_of(ids, len(prompt_ids) // VLLM_BLOCK)
    announced = _announced(table, events)
    expected = _router_hashes([*following, {"role": "user", "content": "Go on."}]).tolist()
    assert table.untranslated == 0
    assert announced == expected[: len(announced)]
    assert len(announced) >= len(_router_hashes(following)) - 1  # the reply's blocks too


@pytest.mark.parametrize(("normalizer", "pre", "config", "prepend"), SP_CASES)
def test_a_sentencepiece_completion_translates_without_the_space_put_before_it(
    tmp_path: Path, normalizer: object, pre: object, config: dict, prepend: str
) -> None:
    table = _sp_table(_sp_tokens(tmp_path, normalizer, pre, config))
    prompt = "A completion keeps its blocks, é 中文. " * 8
    ids = [SP_BOS_ID, *_sp_encode(prompt, prepend)]  # the post-processor's BOS, then the text
    announced = _announced(table, _events_of(ids, len(ids) // VLLM_BLOCK))
    expected = _completion_hashes(prompt)
    assert table.untranslated == 0
    assert announced == expected[: len(announced)].tolist()
    assert len(announced) >= len(prompt.encode()) // BLOCK - 1


def test_whitespace_an_added_token_absorbs_is_left_out_of_the_layout(tmp_path: Path) -> None:
    """An added token with lstrip / rstrip (Phi-3's markers) takes the whitespace beside it
    into its match, and its id spells only its own text: the layout is learnt without it.
    Expected spellings are what HF tokenizers 0.23 encoded (a Metaspace "first" tokeniser
    with <|a|> rstrip and <|e|> lstrip): '<|a|>\\nhi <|e|>\\n<|a|>  x' -> <|a|> h i <|e|>
    \\n <|a|> x; 'ab \\n<|e|>cd' -> ▁ a b <|e|> c d."""
    added = [
        cache_events.AddedToken("<|a|>", rstrip=True),
        cache_events.AddedToken("<|e|>", lstrip=True),
    ]
    tokens = TokenBytes([b""], prepend="first", added=added)
    assert tokens.as_tokenized("<|a|>\nhi <|e|>\n<|a|>  x") == "<|a|>hi<|e|>\n<|a|>x"
    assert tokens.as_tokenized("ab \n<|e|>cd") == " ab<|e|>cd"
    byte_level = TokenBytes([b""], added=added)  # no "▁", the absorbing still
    assert byte_level.as_tokenized("ab \n<|e|>cd <|a|> \nx") == "ab<|e|>cd <|a|>x"
    assert (
        TokenBytes([b""], added=[cache_events.AddedToken("<|a|>")]).as_tokenized("<|a|> x")
        == "<|a|> x"
    )

    # A byte-level tokeniser whose header end absorbs the "\n\n" after it: a chat's events
    # translate into the next turn's router hashes, reply included.
    spec = {
        "decoder": {"type": "ByteLevel"},
        "normalizer": None,
        "model": {"type": "BPE", "vocab": VOCAB},
        "added_tokens": [
            {"id": i, "content": t, "special": True, "rstrip": t == "<|end_header|>"}
            for i, t in enumerate(SPECIAL_TOKENS)
        ],
    }
    path = tmp_path / "tokenizer.json"
    path.write_bytes(orjson.dumps(spec))
    absorbing = TokenBytes.from_file(path)
    layout = ChatLayout.from_template(
        CHAT_TEMPLATE, bos_token=BOS, tokenized=absorbing.as_tokenized
    )
    table = EndpointCacheEvents(Translation(absorbing, layout, MODEL, BLOCK, 4096))
    prompt = _rendered(_first_turn()).replace("<|end_header|>\n\n", "<|end_header|>")
    ids = _encode(prompt + REPLY)
    announced = _announced(table, _events_of(ids, len(_encode(prompt)) // VLLM_BLOCK))
    following = [*_first_turn(), {"role": "assistant", "content": REPLY}]
    expected = _router_hashes([*following, {"role": "user", "content": "Go on."}]).tolist()
    assert table.untranslated == 0
    assert announced == expected[: len(announced)]
    assert len(announced) >= len(_router_hashes(following)) - 1
    plain = EndpointCacheEvents(
        Translation(absorbing, ChatLayout.from_template(CHAT_TEMPLATE, BOS), MODEL, BLOCK, 4096)
    )
    learnt = _announced(plain, _events_of(ids, len(_encode(prompt)) // VLLM_BLOCK))
    assert learnt[:2] != expected[:2]  # learnt as rendered, the layout reads none of it


def test_a_model_directory_vllm_serves_with_mistral_common_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's tokenizer_mode auto renders Mistral's own repositories (consolidated weights
    and tekken.json / tokenizer.model.v3) with mistral_common, not the chat template."""
    spec = {"decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": VOCAB}}
    (tmp_path / "tokenizer.json").write_bytes(orjson.dumps(spec))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": BOS}
    (tmp_path / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    cache_events.load_translation(tmp_path, MODEL, BLOCK, 4096)
    (tmp_path / "tokenizer.model.v3").write_bytes(b"")
    cache_events.load_translation(tmp_path, MODEL, BLOCK, 4096)
    assert "mistral_common" not in caplog.text  # HF weights: tokenizer_mode auto is hf
    (tmp_path / "consolidated.safetensors").write_bytes(b"")
    with caplog.at_level("WARNING"):
        cache_events.load_translation(tmp_path, MODEL, BLOCK, 4096)
    assert "mistral_common" in caplog.text and "--tokenizer-mode hf" in caplog.text


async def test_a_restart_the_metrics_show_starts_the_events_over(
    tmp_path: Path, translation: Translation
) -> None:
    """A server restarted, and before the subscriber heard from it again the new one
    published past the sequence number last read, so the sequence alone does not tell. Its
    metrics do (the service hands the restart on): the table is emptied and the replay
    socket asked for everything the new server buffered, from its first message. Asked
    from the number last read, the new server's first messages (its prompt's blocks) are
    missed and what extends them does not translate."""
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    events = _events_of(prompt + _encode(REPLY), len(prompt) // VLLM_BLOCK)
    whole = _router_hashes(
        [*messages, {"role": "assistant", "content": REPLY}, {"role": "user", "content": "x"}]
    )
    endpoint = "127.0.0.1:8002"
    router = Router(RoutingConfig(block_size_bytes=BLOCK), [EndpointConfig(address=endpoint)])
    config = CacheEventsConfig(
        publisher=f"ipc://{tmp_path}/kv-{{port}}.ipc",
        replay=f"ipc://{tmp_path}/replay-{{port}}.ipc",
        model_dir="x",
        model=MODEL,
    )
    subscriber = CacheEventSubscriber(
        config, translation, lambda: [endpoint], router.observe_cache_events
    )
    context = zmq.asyncio.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path}/kv-8002.ipc")
    replayer = context.socket(zmq.ROUTER)
    replayer.bind(f"ipc://{tmp_path}/replay-8002.ipc")
    buffered: list[bytes] = []  # what the publisher keeps for replay, from sequence 0

    async def serve_replays() -> None:
        while True:
            client, _, start = await replayer.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), len(buffered)):
                await replayer.send_multipart(
                    [client, b"", b"", seq.to_bytes(8, "big"), buffered[seq]]
                )
            await replayer.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    server = asyncio.create_task(serve_replays())
    subscriber.start()
    counts = subscriber.counts
    try:
        deadline = asyncio.get_running_loop().time() + 10
        # The old server's blocks (its own hashes: the hash seed changes with the process),
        # read once the SUB socket has joined.
        old = {**events[0], "block_hashes": [1000 + h for h in events[0]["block_hashes"]]}
        while not router.index.match(whole, [endpoint]):
            assert asyncio.get_running_loop().time() < deadline, counts
            buffered.append(msgspec.msgpack.encode([0.0, [old], 0]))
            await publisher.send_multipart(
                [b"kv", (len(buffered) - 1).to_bytes(8, "big"), buffered[-1]]
            )
            await asyncio.sleep(0.1)
        last_read = len(buffered) - 1
        # It restarts; the new server publishes its request's blocks, one message each,
        # then nothing, past the number last read; the subscriber hears only the last.
        buffered = [msgspec.msgpack.encode([0.0, [event], 0]) for event in events[:-1]]
        buffered += [msgspec.msgpack.encode([0.0, [], 0])] * (last_read + 1)
        replayed = counts[endpoint, "replayed_messages"]  # (the old server's, if it joined late)
        router.restarted(endpoint)
        subscriber.restarted(endpoint)  # as the service does when the metrics show it
        live = len(buffered)
        assert live > last_read + 1
        await publisher.send_multipart(
            [b"kv", live.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [events[-1]], 0])]
        )
        while (
            not counts[endpoint, "untranslated_blocks"]
            + counts[endpoint, "replayed_messages"]
            - replayed
        ):
            assert asyncio.get_running_loop().time() < deadline, counts
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert counts[endpoint, "restarts"] == 1
        assert counts[endpoint, "replayed_messages"] - replayed == live
        assert counts[endpoint, "untranslated_blocks"] == 0
        matched = router.index.match(whole, [endpoint]).get(endpoint, 0)
        assert matched >= len(whole) - 1, (matched, len(whole))
        assert len(subscriber.tables[endpoint]) == len(events) - 1 + len(events[0]["block_hashes"])
    finally:
        await subscriber.stop()
        server.cancel()
        publisher.close(linger=0)
        replayer.close(linger=0)
        context.term()


def _events_service(
    tmp_path: Path, translation: Translation, endpoints: str, **settings: object
) -> RouterService:
    """A router service (not started: no ports) reading KV-cache events of ``endpoints``."""
    config = load_config(
        None,
        {
            "server.listen": "127.0.0.1:0",
            "server.admin_listen": "",
            "endpoints": endpoints,
            "health.enabled": False,
            "cache_events.publisher": f"ipc://{tmp_path}/kv-{{port}}.ipc",
            "cache_events.model_dir": str(tmp_path),
            "cache_events.model": MODEL,
            **settings,
        },
        environ={},
    )
    return RouterService(config, translation=translation)


async def test_the_service_hands_a_restart_its_metrics_show_to_the_subscriber(
    tmp_path: Path, translation: Translation, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extproc.signals import EndpointSignals

    endpoint = "127.0.0.1:8002"
    service = _events_service(tmp_path, translation, endpoint)
    assert service.cache_events is not None
    told: list[str] = []
    monkeypatch.setattr(
        service.cache_events, "restarted", lambda endpoint, started: told.append(endpoint) or True
    )
    try:
        service.scraper.record(endpoint, EndpointSignals(up=True, started=1000.0))
        service.scraper.record(endpoint, EndpointSignals(up=True, started=1000.0))
        assert told == []
        service.scraper.record(endpoint, EndpointSignals(up=True, started=2000.0))
        assert told == [endpoint]
    finally:
        await service.cache_events.stop()


@pytest.mark.parametrize("told_by", ["start time", "counters"])
async def test_a_restart_the_sequence_told_first_is_not_told_again_by_the_metrics(
    tmp_path: Path, translation: Translation, told_by: str
) -> None:
    """The events' sequence started over (the new server's first messages read) before a
    scrape showed the new process start time (or, without one, counters that went down):
    the restart was handled then, and the blocks read since are the new server's, so the
    metrics' news keeps them (emptied again, up to a scrape interval of them were lost and
    the restart counted twice). A restart after the one the sequence told still empties
    the endpoint's index."""
    from extproc.signals import EndpointSignals

    def reading(started: float, queries: float, at: float) -> EndpointSignals:
        """The server started at ``started`` and scraped at ``at``: ``queries`` so far."""
        service.scraper.clock = lambda: at
        if told_by == "start time":
            return EndpointSignals(up=True, started=started, queries=queries)
        return EndpointSignals(up=True, queries=queries)

    endpoint = "127.0.0.1:8002"
    service = _events_service(
        tmp_path, translation, endpoint, **{"routing.block_size_bytes": BLOCK}
    )
    subscriber = service.cache_events
    assert subscriber is not None
    subscriber.tables[endpoint] = EndpointCacheEvents(translation)
    subscriber.clock = lambda: 1_000.0
    messages = _first_turn()
    prompt = _encode(_rendered(messages))
    events = _events_of(prompt, len(prompt) // VLLM_BLOCK)
    hashes = _router_hashes(messages)
    old = {**events[0], "block_hashes": [1000 + h for h in events[0]["block_hashes"]]}

    def frames(sequence: int, payload: list[dict[str, object]]) -> list[bytes]:
        return [b"kv", sequence.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, payload, 0])]

    try:
        service.scraper.record(endpoint, reading(100.0, 0.0, 101.0))
        service.scraper.record(endpoint, reading(100.0, 90_000.0, 981.0))  # last read
        expected = None
        for sequence in range(4):  # the old server's
            expected = await subscriber.handle(endpoint, frames(sequence, [old]), expected)
        # The new server (started at 990) publishes its first request's blocks: the
        # sequence starts over at 1,000.
        expected = await subscriber.handle(endpoint, frames(0, events), expected)
        assert subscriber.counts[endpoint, "restarts"] == 1
        held = service.router.index.match(hashes, [endpoint])
        assert held.get(endpoint, 0) >= len(hashes) - 1, held
        stored = len(subscriber.tables[endpoint])
        service.scraper.record(endpoint, reading(990.0, 64.0, 1_001.0))
        assert service.scraper.latest[endpoint].restarted
        assert service.router.index.match(hashes, [endpoint]) == held
        expected = await subscriber.handle(endpoint, frames(expected or 0, []), expected)
        assert len(subscriber.tables[endpoint]) == stored
        assert endpoint not in subscriber._restarted  # the next message does not clear it
        assert subscriber.counts[endpoint, "restarts"] == 1
        # Restarted again, after that; its new sequence not yet read: the metrics tell it.
        service.scraper.record(endpoint, reading(990.0, 9_000.0, 1_003.0))
        service.scraper.record(endpoint, reading(1_010.0, 64.0, 1_011.0))
        assert service.router.index.match(hashes, [endpoint]) == {}
        assert endpoint in subscriber._restarted
    finally:
        await subscriber.stop()


async def test_events_are_read_only_from_the_pool_of_their_model(
    tmp_path: Path, translation: Translation
) -> None:
    """With several model pools behind the router, another model's servers (another
    tokeniser) are not subscribed to; those whose models are not known yet still are."""
    pool, other, unknown = "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"
    service = _events_service(tmp_path, translation, f"{pool},{other},{unknown}")
    try:
        service.router.observe_models(pool, frozenset({MODEL, "a-lora"}))
        service.router.observe_models(other, frozenset({"another-model"}))
        assert service._endpoints_of_the_events_model() == [pool, unknown]
    finally:
        assert service.cache_events is not None
        await service.cache_events.stop()
