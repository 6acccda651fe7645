"""`prefix-router bench events`: what translating vLLM's KV-cache events costs the router.

The translation (cache_events.py) runs off the hot path, on the router's event loop
between decisions, so its cost is CPU the decisions share, not time a request waits. Per
prompt size: one request's prompt stored in one event (vLLM announces a prefill's blocks
together), each block its reply then fills (one event per block: each re-reads the whole
chain), and the chain evicted. The tokeniser is synthetic byte-level BPE with whole words
as tokens (~6 bytes a token, real ones ~4) and the fixture model's chat template.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from .cache_events import (
    ChatLayout,
    EndpointCacheEvents,
    TokenBytes,
    Translation,
    byte_level_alphabet,
    template_environment,
)
from .config import RoutingConfig
from .model_fixture import _ENGLISH, BOS, CHAT_TEMPLATE, SPECIAL_TOKENS

WORDS = [f"w{i:03d}x" for i in range(2000)]
REPLY_BLOCKS = 32
# Run in the vLLM environment (where `tokenizers` is): the median time to encode stdin.
_ENCODE_TIMER = """
import sys, time, statistics
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
text = sys.stdin.read()
times = []
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    tokenizer.encode(text, add_special_tokens=False)
    times.append(time.perf_counter() - started)
print(statistics.median(times) * 1000)
"""


def encode_ms(text: str, repeats: int) -> float:
    """What tokenising the prompt on the hot path would cost instead: the tiny model's
    byte-level BPE tokenizer (4,096 tokens; HF `tokenizers`, Rust) in the vLLM environment."""
    from . import lab

    python = lab.ensure_vllm_env(quiet=True)
    model = lab.ensure_model(python, quiet=True)
    result = subprocess.run(
        [str(python), "-c", _ENCODE_TIMER, str(model / "tokenizer.json"), str(repeats)],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(result.stdout.strip())


class _Vocabulary:
    """Special tokens, the 256 bytes, and ' word' for each word: enough to encode the
    rendered template of prompts made of WORDS."""

    def __init__(self) -> None:
        byte_char = byte_level_alphabet()
        self.tokens = list(SPECIAL_TOKENS) + [byte_char[b] for b in range(256)]
        self.tokens += [byte_char[32] + w for w in WORDS]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self._byte_char = byte_char
        self._pattern = re.compile(
            "|".join(re.escape(t) for t in SPECIAL_TOKENS) + r"| w\d+x|.", re.DOTALL
        )

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._pattern.findall(text):
            key = self._byte_char[32] + piece[1:] if piece.startswith(" w") else piece
            if key in self.ids:
                ids.append(self.ids[key])
            else:
                ids += [self.ids[self._byte_char[b]] for b in piece.encode()]
        return ids

    def table(self) -> TokenBytes:
        to_byte = {c: b for b, c in self._byte_char.items()}
        return TokenBytes(
            [
                t.encode() if t in SPECIAL_TOKENS else bytes(to_byte[c] for c in t)
                for t in self.tokens
            ]
        )


def stored_event(ids: list[int], first: int, last: int, block: int) -> dict[str, Any]:
    """vLLM's BlockStored for blocks first..last - 1 of a chain of token ids (vLLM hash =
    block number + 1, so a chain's parent links follow from the numbers)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first + 1, last + 1)),
        "parent_block_hash": first or None,
        "token_ids": ids[first * block : last * block],
        "block_size": block,
        "medium": "GPU",
        "extra_keys": [None] * (last - first),
    }


def _events(ids: list[int], first: int, last: int, block: int) -> list[dict[str, Any]]:
    return [stored_event(ids, first, last, block)]


def _user_prompt_event(vocabulary: _Vocabulary, content: str) -> dict[str, Any]:
    """One user message's prompt, rendered by the fixture's template, stored whole."""
    rendered = (
        template_environment()
        .from_string(CHAT_TEMPLATE)
        .render(
            messages=[{"role": "user", "content": content}],
            add_generation_prompt=True,
            bos_token=BOS,
        )
    )
    ids = vocabulary.encode(rendered)
    return stored_event(ids, 0, len(ids) // 16, 16)


def _as_new_chain(event: dict[str, Any], k: int) -> dict[str, Any]:
    """The same blocks under other vLLM hashes: another chain to the table."""
    return event | {"block_hashes": [h + k * 10**7 for h in event["block_hashes"]]}


def measure(
    size_kib: int,
    vocabulary: _Vocabulary,
    translation: Translation,
    block: int,
    repeats: int,
    encode: bool = False,
    turns: int = 1,
) -> dict[str, float]:
    rng = random.Random(size_kib)
    words = max(1, size_kib * 1024 // 6 // turns)
    messages = [{"role": "system", "content": "You help."}] + [
        {
            "role": ("user", "assistant")[k % 2],
            "content": "".join(" " + rng.choice(WORDS) for _ in range(words)),
        }
        for k in range(turns)
    ]
    rendered = (
        template_environment()
        .from_string(CHAT_TEMPLATE)
        .render(messages=messages, add_generation_prompt=True, bos_token=BOS)
    )
    reply = "".join(" " + rng.choice(WORDS) for _ in range(REPLY_BLOCKS * block))
    ids = vocabulary.encode(rendered + reply)
    prompt_blocks = len(vocabulary.encode(rendered)) // block
    stored, reply_each, removed, hashes = [], [], [], 0
    for _ in range(repeats):
        table = EndpointCacheEvents(translation)
        started = time.perf_counter()
        changes = table.apply(_events(ids, 0, prompt_blocks, block))
        stored.append(time.perf_counter() - started)
        started = time.perf_counter()
        for k in range(prompt_blocks, prompt_blocks + REPLY_BLOCKS):
            changes += table.apply(_events(ids, k, k + 1, block))
        reply_each.append((time.perf_counter() - started) / REPLY_BLOCKS)
        hashes = sum(len(h) for _, h in changes)
        started = time.perf_counter()
        table.apply(
            [
                {
                    "type": "BlockRemoved",
                    "block_hashes": list(range(1, prompt_blocks + REPLY_BLOCKS + 1)),
                }
            ]
        )
        removed.append(time.perf_counter() - started)
    tracemalloc.start()  # untimed: what the endpoint's table keeps per announced block
    table = EndpointCacheEvents(translation, tip_bytes=0)
    before = tracemalloc.get_traced_memory()[0]
    table.apply(_events(ids, 0, prompt_blocks, block))
    per_block = (tracemalloc.get_traced_memory()[0] - before) / prompt_blocks
    tracemalloc.stop()
    row: dict[str, float] = {}
    if encode:  # English words, as the tokenizer was trained on
        english = _ENGLISH.split()
        text = "".join(" " + rng.choice(english) for _ in range(size_kib * 1024 // 5))
        row["encode_ms"] = encode_ms(text[: size_kib * 1024], repeats)
    return row | {
        "table_bytes_per_block": per_block,
        "prompt_kib": size_kib,
        "messages": len(messages),
        "prompt_tokens": prompt_blocks * block,
        "vllm_blocks": prompt_blocks,
        "router_blocks": hashes,
        "prompt_event_ms": statistics.median(stored) * 1000,
        "reply_block_event_ms": statistics.median(reply_each) * 1000,
        "eviction_ms": statistics.median(removed) * 1000,
    }


def backlog_stall(
    size_kib: int, messages: int, vocabulary: _Vocabulary, translation: Translation
) -> dict[str, float]:
    """How long a decision can wait behind a backlog: ``messages`` messages, each a new
    ``size_kib`` prompt's blocks, published at once on a real ZMQ socket (ipc://) to the
    server's subscriber feeding a router, while a 1 ms ticker on the same event loop (a
    stand-in for decisions) records how late it wakes."""
    import asyncio
    import tempfile

    import msgspec
    import zmq

    from .cache_subscriber import CacheEventSubscriber
    from .config import CacheEventsConfig, EndpointConfig
    from .router import Router

    rng = random.Random(size_kib)
    payloads = []
    for k in range(messages):
        content = "".join(" " + rng.choice(WORDS) for _ in range(size_kib * 1024 // 6))
        event = _as_new_chain(_user_prompt_event(vocabulary, f"{k}{content}"), k)
        payloads.append(msgspec.msgpack.encode([0.0, [event], 0]))
    endpoint = "127.0.0.1:8001"
    router = Router(
        RoutingConfig(block_size_bytes=translation.block_size, max_blocks=translation.max_blocks),
        [EndpointConfig(address=endpoint)],
    )

    async def run() -> dict[str, float]:
        directory = tempfile.mkdtemp(prefix="bench-events-")
        config = CacheEventsConfig(
            publisher=f"ipc://{directory}/kv-{{port}}.ipc",
            topic="kv",
            model_dir=directory,
            model=translation.model,
        )
        handled: list[int] = []  # one per message the subscriber finished
        subscriber = CacheEventSubscriber(
            config, translation, lambda: [endpoint], router.observe_cache_events
        )
        handle = subscriber.handle

        async def counted(*args: Any, **kwargs: Any) -> int | None:
            expected = await handle(*args, **kwargs)
            handled.append(1)
            return expected

        subscriber.handle = counted  # type: ignore[method-assign]
        context = zmq.Context()
        publisher = context.socket(zmq.PUB)
        publisher.setsockopt(zmq.SNDHWM, 1_000_000)
        publisher.bind(f"ipc://{directory}/kv-8001.ipc")
        subscriber.start()
        try:
            cleared = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}], 0])
            while not handled:  # a SUB socket joins late: until it hears one
                publisher.send_multipart([b"kv", (0).to_bytes(8, "big"), cleared])
                await asyncio.sleep(0.05)
            before = len(handled)
            for k, payload in enumerate(payloads, start=1):
                publisher.send_multipart([b"kv", k.to_bytes(8, "big"), payload])
            late, started = [], time.perf_counter()
            while len(handled) < before + messages and time.perf_counter() - started < 120:
                tick = time.perf_counter()
                await asyncio.sleep(0.001)
                late.append((time.perf_counter() - tick) * 1000 - 1.0)
            took = time.perf_counter() - started
        finally:
            await subscriber.stop()
            publisher.close(linger=0)
            context.term()
        late.sort()
        return {
            "prompt_kib": size_kib,
            "messages": messages,
            "handled_ms": took * 1000,
            "ticks": len(late),
            "late_p50_ms": statistics.median(late),
            "late_max_ms": late[-1],
        }

    return asyncio.run(run())


def full_collection_ms(blocks: int, vocabulary: _Vocabulary, translation: Translation) -> float:
    """What a full garbage collection costs with an endpoint's table holding ``blocks``
    announced blocks (32 KiB prompts, each a new chain): a pause every decision waits out,
    which grows with what the collector tracks (median of three ``gc.collect()``)."""
    from .bench_core import full_collections_ms

    rng = random.Random(blocks)
    content = "".join(" " + rng.choice(WORDS) for _ in range(32 * 1024 // 6))
    event = _user_prompt_event(vocabulary, content)
    table = EndpointCacheEvents(translation, max_table_blocks=blocks)
    k = 0
    while len(table) < blocks:
        k += 1
        table.apply([_as_new_chain(event, k)])
        if not len(table):
            raise RuntimeError("bench events --gc-blocks: the prompt did not translate")
    return statistics.median(full_collections_ms(3))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="8,32,128,512", help="prompt sizes in KiB")
    parser.add_argument("--vllm-block", type=int, default=16, help="vLLM block size (tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per size (median)")
    parser.add_argument("--json", dest="json_out", help="write the results here")
    parser.add_argument(
        "--gc-blocks",
        type=int,
        default=0,
        metavar="N",
        help="also time a full garbage collection with an endpoint's table holding N blocks",
    )
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        metavar="N",
        help="also publish N messages of each size's prompt at once on a real ZMQ socket to "
        "the server's subscriber, and report how late a 1 ms ticker on its event loop wakes",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        help="messages the prompt's text is split into after the system prompt (user and "
        "assistant in turn): a long conversation's cost",
    )
    parser.add_argument(
        "--encode",
        action="store_true",
        help="also time tokenising each prompt's text as the hot path would have to (the "
        "tiny model's tokenizer, in the vLLM environment: installed on first use)",
    )


def run(args: argparse.Namespace) -> int:
    vocabulary = _Vocabulary()
    routing = RoutingConfig()
    layout = ChatLayout.from_template(CHAT_TEMPLATE, bos_token=BOS)
    translation = Translation(
        vocabulary.table(), layout, "bench", routing.block_size_bytes, routing.max_blocks
    )
    rows = [
        measure(
            int(size),
            vocabulary,
            translation,
            args.vllm_block,
            args.repeats,
            args.encode,
            args.turns,
        )
        for size in args.sizes.split(",")
    ]
    print(
        f"KV-cache event translation (vLLM block {args.vllm_block} tokens, router block "
        f"{routing.block_size_bytes} B, window {routing.max_blocks} blocks; a system prompt "
        f"and {args.turns} message(s); median of {args.repeats})"
    )
    print(
        "| prompt KiB | tokens | vLLM blocks | router blocks | prompt event ms | "
        "each reply block's event ms | eviction ms | table bytes per vLLM block |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['prompt_kib']} | {row['prompt_tokens']:,} | {row['vllm_blocks']:,} | "
            f"{row['router_blocks']:,} | {row['prompt_event_ms']:.2f} | "
            f"{row['reply_block_event_ms']:.2f} | {row['eviction_ms']:.2f} | "
            f"{row['table_bytes_per_block']:.0f} |"
        )
    backlog = [
        backlog_stall(int(size), args.backlog, vocabulary, translation)
        for size in (args.sizes.split(",") if args.backlog else [])
    ]
    if backlog:
        print(
            f"\nA backlog of {args.backlog} messages (one new prompt each) through the "
            "subscriber, with a 1 ms ticker on its event loop:"
        )
        print("| prompt KiB | handled in ms | ticks | ticker late p50 ms | max ms |")
        print("|---:|---:|---:|---:|---:|")
        for row in backlog:
            print(
                f"| {row['prompt_kib']} | {row['handled_ms']:.0f} | {row['ticks']} | "
                f"{row['late_p50_ms']:.2f} | {row['late_max_ms']:.1f} |"
            )
    collection = (
        full_collection_ms(args.gc_blocks, vocabulary, translation) if args.gc_blocks else None
    )
    if collection is not None:
        print(
            f"\nA full garbage collection with {args.gc_blocks:,} blocks in the table: "
            f"{collection:.1f} ms (median of 3)"
        )
    if args.encode:
        print("\nTokenising instead, on the hot path (median ms to encode the prompt's text):")
        print("| prompt KiB | encode ms |\n|---:|---:|")
        for row in rows:
            print(f"| {row['prompt_kib']} | {row['encode_ms']:.2f} |")
    if args.json_out:
        command = "prefix-router bench events " + " ".join(sys.argv[3:])
        document = {"command": command, "rows": rows, "backlog": backlog}
        if collection is not None:
            document["full_collection"] = {"blocks": args.gc_blocks, "ms": collection}
        Path(args.json_out).write_text(json.dumps(document, indent=2) + "\n")
    return 0
