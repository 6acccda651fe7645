"""Real vLLM's KV-cache events, translated into the router's own block hashes.

One vLLM CPU server publishes its events on an ipc:// socket (nothing listens on a port);
the test subscribes as a router would, sends a conversation's first turn straight to vLLM
(as another router replica would), and checks that the translated events are exactly the
router hashes of the conversation's next turn, reply included, as far as vLLM computed it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import urllib.error
import urllib.request
import zoneinfo
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import orjson
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from extproc import bench_live, cache_events, lab, model_fixture, tokenizer_probe
from extproc.bench_events import stored_event
from extproc.config import RoutingConfig
from extproc.hashing import block_hashes, root_hash
from extproc.prompt import parse_request
from extproc.stack import LOOPBACK, Stack

from ..replica_calls import post as _post
from ..router_gauges import models_known
from ..waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
T = TypeVar("T")


@dataclass(frozen=True)
class EventsServer:
    """One vLLM server publishing its KV-cache events on ipc:// sockets in ``directory``
    (lab.kv_events_args: the event and replay sockets named by its port)."""

    address: str
    directory: Path
    model_dir: Path

    @property
    def socket(self) -> str:
        return f"ipc://{self.directory}/kv-{self.address.rsplit(':', 1)[1]}.ipc"

    def router_args(self) -> list[str]:
        """A router's settings to read them (what bench live's prefix_k2_events uses)."""
        return lab.router_kv_events_args(self.directory, self.model_dir)


@pytest.fixture(scope="module")
def vllm_with_events(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventsServer]:
    directory = tmp_path_factory.mktemp("vllm-events")
    with lab.vllm_servers(1, directory, kv_events_dir=directory) as servers:
        bench_live.warm_up([servers[0].address], lab.SERVED_MODEL_NAME)
        yield EventsServer(servers[0].address, directory, lab.ensure_model(lab.ensure_vllm_env()))


def _chat(address: str, messages: list[dict[str, str]], model: str = lab.SERVED_MODEL_NAME) -> str:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": 96,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://{address}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def _translated(translator: cache_events.EndpointCacheEvents, received: list) -> list[int]:
    """The router hashes a table stored from these messages, in order."""
    return [
        h
        for frames in received
        for held, hashes in translator.apply(cache_events.decode_message(frames)[1])
        if held
        for h in hashes.tolist()
    ]


def _complete(address: str, prompt: str) -> str:
    body = {"model": lab.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 96, "temperature": 0}
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"]


@contextlib.contextmanager
def _listening(
    server: EventsServer, model_dir: Path | None = None, socket: str | None = None
) -> Iterator[tuple[cache_events.EndpointCacheEvents, zmq.Socket]]:
    """A table translating the server's events (its model's files, or ``model_dir``'s) and
    a SUB socket on them, joined and drained after a reset of the server's cache (blocks
    cached before would extend parents the table never saw)."""
    routing = RoutingConfig()
    translation = cache_events.load_translation(
        model_dir or server.model_dir,
        lab.SERVED_MODEL_NAME,
        routing.block_size_bytes,
        routing.max_blocks,
    )
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(socket or server.socket)
    try:
        time.sleep(0.5)  # a SUB socket misses what is published before it joins
        _post(server.address, "/reset_prefix_cache")
        _read_events(subscriber)
        yield cache_events.EndpointCacheEvents(translation), subscriber
    finally:
        subscriber.close(linger=0)


@contextlib.contextmanager
def _another_server(
    name: str,
    directory: Path,
    tokenizer_dir: Path,
    extra_args: list[str],
    extra_env: dict[str, str] | None = None,
) -> Iterator[EventsServer]:
    """A second vLLM server for the tiny model on the other core, started with
    ``extra_args`` (and ``extra_env``), publishing its events in ``directory``;
    ``tokenizer_dir`` holds the tokeniser files it serves with. Stopped on exit."""
    python = lab.ensure_vllm_env()
    server = lab.start_vllm(
        python,
        lab.ensure_model(python),
        name,
        lab.core_for(1),
        directory,
        extra_args=extra_args,
        kv_events_dir=directory,
        extra_env=extra_env,
    )
    try:
        lab.wait_healthy([server])
        yield EventsServer(server.address, directory, tokenizer_dir)
    finally:
        lab.stop_all([server])


def _read_events(subscriber: zmq.Socket, quiet_seconds: float = 1.5) -> list[list[bytes]]:
    """Every message until none came for ``quiet_seconds``."""
    messages = []
    while subscriber.poll(int(quiet_seconds * 1000)):
        messages.append(subscriber.recv_multipart())
    return messages


def test_vllms_events_translate_to_the_next_turns_router_hashes(
    vllm_with_events: EventsServer,
) -> None:
    address = vllm_with_events.address
    with _listening(vllm_with_events) as (translator, subscriber):
        messages = [
            {"role": "system", "content": "You answer questions about caches, briefly. " * 12},
            {"role": "user", "content": "Why does a prefix cache need whole blocks? é 中文 " * 6},
        ]
        reply = _chat(address, messages)
        received = _read_events(subscriber)
        sequences, stored, removed = [], [], []
        for frames in received:
            sequence, events = cache_events.decode_message(frames)
            sequences.append(sequence)
            for held, hashes in translator.apply(events):
                if held is not None:
                    (stored if held else removed).append(hashes)
        assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
        announced = np.concatenate(stored) if stored else np.zeros(0, np.uint64)

        expected = _router_hashes("chat", {"messages": _then(messages, reply, "Go on.")})
        prompt_blocks = _router_blocks(messages)
        print(
            f"{len(received)} event messages; {len(announced)} router blocks announced, "
            f"the first turn's prompt has {prompt_blocks}, the next turn {len(expected)}; "
            f"untranslated vLLM blocks {translator.untranslated}"
        )
        assert not removed and translator.untranslated == 0
        # Exactly the next turn's hashes, in order, and past the first turn's prompt: the
        # reply's blocks, computed by vLLM, are announced and meet the router's hashes too.
        assert announced.tolist() == expected[: len(announced)]
        assert len(announced) > prompt_blocks, (len(announced), prompt_blocks)

        # vLLM publishes a cleared cache with the next blocks it stores, in one message.
        _post(address, "/reset_prefix_cache")
        _chat(address, [{"role": "user", "content": "Short question."}])
        changes = [
            change
            for frames in _read_events(subscriber)
            for change in translator.apply(cache_events.decode_message(frames)[1])
        ]
        assert changes and changes[0][0] is None, changes  # cleared, then what came after
        assert all(held for held, _ in changes[1:]), changes
        assert len(translator) < 10  # the first turn's blocks are gone from the table


def test_vllms_events_of_a_completion_translate_to_the_next_requests_router_hashes(
    vllm_with_events: EventsServer,
) -> None:
    """A completions prompt (no chat template): its blocks are the router hashes of its
    text, and the reply's blocks those of the next request that carries the context on."""
    routing = RoutingConfig()
    with _listening(vllm_with_events) as (translator, subscriber):
        prompt = "A completion about prefix caches keeps its blocks, é 中文. " * 10
        reply = _complete(vllm_with_events.address, prompt)
        announced = _translated(translator, _read_events(subscriber))

    expected = _router_hashes("completions", {"prompt": prompt + reply + " And then?"})
    prompt_blocks = len(prompt.encode()) // routing.block_size_bytes
    print(
        f"{len(announced)} router blocks announced; the prompt has {prompt_blocks}, the next "
        f"request {len(expected)}; untranslated vLLM blocks {translator.untranslated}"
    )
    assert translator.untranslated == 0
    assert announced == expected[: len(announced)]
    assert len(announced) > prompt_blocks  # the reply's blocks meet the next request's too


def test_a_template_that_prints_the_date_reads_on_a_server_whose_day_is_another(
    vllm_with_events: EventsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat template that prints today's date (Llama 3.2's) renders a different start each
    day. A second vLLM server renders it in a time zone whose date is not this process's
    (what a router sees for the hours around midnight, or against a server on another
    clock): its events still translate into the next turn's router hashes, through the
    neighbouring day's layout. A layout learnt once, for this process's day, reads none."""
    here = datetime.datetime.now().date()
    zone = next(
        z
        for z in ("Etc/GMT-14", "Etc/GMT+12")  # UTC+14 and UTC-12: one differs from any day
        if datetime.datetime.now(zoneinfo.ZoneInfo(z)).date() != here
    )
    model_dir = vllm_with_events.model_dir
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": model_fixture.DATED_CHAT_TEMPLATE})
    )
    (tmp_path / "dated.jinja").write_text(model_fixture.DATED_CHAT_TEMPLATE)
    routing = RoutingConfig()
    messages = [
        {"role": "system", "content": "You date your answers, briefly. " * 10},
        {"role": "user", "content": "Which day is it where the server runs? " * 5},
    ]
    monkeypatch.setenv("TZ", zone)  # for the server only: this process keeps its zone
    args = ["--chat-template", str(tmp_path / "dated.jinja")]
    with _another_server("vllm-dated", tmp_path, tokenizer_dir, args) as dated:
        monkeypatch.delenv("TZ")
        with _listening(dated) as (by_day_table, subscriber):
            reply = _chat(dated.address, messages)
            received = _read_events(subscriber)
    translation = cache_events.load_translation(
        tokenizer_dir, lab.SERVED_MODEL_NAME, routing.block_size_bytes, routing.max_blocks
    )
    assert isinstance(translation.layout, cache_events.DatedLayouts) and translation.layout.dated
    once = cache_events.ChatLayout.from_template(
        model_fixture.DATED_CHAT_TEMPLATE, model_fixture.BOS
    )
    once_table = cache_events.EndpointCacheEvents(
        cache_events.Translation(
            translation.tokens, once, translation.model, translation.block_size, 4096
        )
    )
    tables = {"by day": by_day_table, "once": once_table}
    announced = {name: _translated(table, received) for name, table in tables.items()}
    expected = _router_hashes("chat", {"messages": _then(messages, reply, "Go on.")})
    by_day = announced["by day"]
    print(
        f"server zone {zone}: {len(by_day)} router blocks announced by day, of the next "
        f"turn's {len(expected)} (the first turn {_router_blocks(messages)}); learnt once: "
        f"{sum(a == b for a, b in zip(announced['once'], expected, strict=False))} equal"
    )
    assert tables["by day"].untranslated == 0
    assert by_day == expected[: len(by_day)] and len(by_day) > _router_blocks(messages)
    assert announced["once"][:4] != expected[:4]


@pytest.mark.parametrize(
    ("tokenizer_class", "legacy", "prepend"),
    [
        ("LlamaTokenizer", None, "first"),
        ("LlamaTokenizer", True, "always"),
        ("GemmaTokenizer", None, "never"),
    ],
    ids=["llama", "llama-legacy", "gemma"],
)
def test_a_sentencepiece_tokenisers_events_translate_to_the_router_hashes(
    vllm_with_events: EventsServer,
    tmp_path: Path,
    tokenizer_class: str,
    legacy: bool | None,
    prepend: str,
) -> None:
    """A SentencePiece-style tokeniser (Llama 2 / Mistral's: "▁" for spaces, <0xNN> byte
    pieces, [INST] added tokens), served by a second vLLM for the same model
    (``--tokenizer``), as transformers loads it: a "▁" before the text's start only
    (``legacy`` unset), or before every piece between added tokens (``legacy: true``), or
    nowhere (Gemma's class).
    A chat's events translate into its next turn's router hashes, a completion's into
    the next request's (its prompt's first "▁" is not the prompt's), replies included
    where the template spells them as the model wrote them."""
    python = lab.ensure_vllm_env()
    tokenizer_dir = lab.sentencepiece_tokenizer(
        python, vllm_with_events.model_dir, tmp_path / "sp", legacy, tokenizer_class
    )
    routing = RoutingConfig()
    messages = [
        {"role": "system", "content": "You answer in short sentences. " * 6},
        {"role": "user", "content": "Why do pieces start with a space? é 中文 " * 4},
    ]
    prompt = "A completion about prefix caches, é 中文. " * 6
    args = ["--tokenizer", str(tokenizer_dir)]
    with _another_server("vllm-sentencepiece", tmp_path, tokenizer_dir, args) as served:
        with _listening(served) as (table, subscriber):
            reply = _chat(served.address, messages)
            chat = _translated(table, _read_events(subscriber))
            chat_untranslated = table.untranslated
            completion = _complete(served.address, prompt)
            completed = _translated(table, _read_events(subscriber))
        # The server's path too: a router behind Envoy reading these events (its
        # cache_events.model_dir the tokeniser's) matches a next turn it never saw.
        with Stack() as stack:
            args = [*served.router_args(), "--set", "cache_events.replay="]
            admin, envoy = _router_behind_envoy(stack, served.address, args)
            _post(served.address, "/reset_prefix_cache")
            routed_reply = _chat(served.address, messages)
            _wait_for_count(admin, "stored_blocks", _router_blocks(messages) - 1)
            decision = _routed_through(envoy, admin, _then(messages, routed_reply, "Go on."))
    print(f"through Envoy, the next turn: {_matched(decision)}")
    assert decision["endpoint"] == served.address
    assert decision["matched_blocks"] >= _router_blocks(messages) - 1
    if prepend != "always":  # the reply's blocks too (below)
        assert decision["matched_blocks"] > _router_blocks(messages), decision
    assert table.tokens.prepend == prepend
    expected = _router_hashes("chat", {"messages": _then(messages, reply, "Go on.")})
    expected_completion = _router_hashes("completions", {"prompt": prompt + completion})
    print(
        f"prepend {table.tokens.prepend}: chat {len(chat)} router blocks announced, "
        f"{sum(a == b for a, b in zip(chat, expected, strict=False))} equal to the next "
        f"turn's (first turn {_router_blocks(messages)}, next {len(expected)}; reply "
        f"{reply[:40]!r}); completion {len(completed)} announced, "
        f"{sum(a == b for a, b in zip(completed, expected_completion, strict=False))} equal "
        f"(prompt {len(prompt.encode()) // routing.block_size_bytes}); untranslated vLLM "
        f"blocks {chat_untranslated}, {table.untranslated}"
    )
    first_turn = _router_blocks(messages)
    assert chat_untranslated == 0 and len(chat) >= first_turn
    assert chat[:first_turn] == expected[:first_turn]  # the prompt, exactly
    if prepend != "always":
        # The reply too: the model wrote it right after [/INST], as the template does.
        assert chat == expected[: len(chat)] and len(chat) > first_turn
    # With legacy (a "▁" before every piece after an added token) the template spells the
    # next turn's reply "[/INST]▁her…" where the model wrote "[/INST]her…": vLLM cannot reuse
    # those blocks either (other tokens), and what they translate into meets no request.
    assert completed == expected_completion[: len(completed)]
    assert len(completed) >= len(prompt.encode()) // routing.block_size_bytes - 1


@pytest.mark.parametrize(
    ("version", "legacy", "prepend", "markers"),
    [
        ("v1", None, "first", False),
        ("v1", True, "always", False),
        ("v3", None, "first", False),
        ("v1", False, "first", True),
    ],
    ids=["mistral-v1", "mistral-v1-legacy", "mistral-v3", "phi3-markers"],
)
def test_mistrals_own_vocabularies_translate_to_the_router_hashes(
    tmp_path: Path, version: str, legacy: bool | None, prepend: str, markers: bool
) -> None:
    """Real vocabularies (no server: the tiny model cannot serve 32k pieces): Mistral 7B's
    SentencePiece models as mistral_common ships them, converted and loaded by the vLLM
    environment's transformers, tokenise a conversation's next-turn prompt and a
    completion as vLLM would; the chains translate into exactly the router's hashes. With
    Phi-3's markers (added tokens that absorb the newline after them) and template too."""
    python = lab.ensure_vllm_env()
    directory = tmp_path / "tokenizer"
    flag = "unset" if legacy is None else str(legacy).lower()
    built = lab.run_module(
        python,
        "extproc.tokenizer_probe",
        "mistral",
        "--version",
        version,
        "--legacy",
        flag,
        "--out",
        str(directory),
        *(["--phi3-markers"] if markers else []),
    )
    assert built.returncode == 0, built.stderr[-2000:]
    messages = [
        {"role": "user", "content": "Why do  pieces start with a space? é 中文 🙂\n\tTabbed. " * 6},
        {
            "role": "assistant",
            "content": "Because SentencePiece marks word starts with a mark. " * 3,
        },
        {"role": "user", "content": "Go on, in detail, please.\nAnd again. " * 3},
    ]
    prompt = "A completion about prefix caches,  é 中文 🙂\nnext line. " * 8
    text = (
        cache_events.template_environment()
        .from_string(
            tokenizer_probe.PHI3_CHAT_TEMPLATE if markers else tokenizer_probe.MISTRAL_CHAT_TEMPLATE
        )
        .render(messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    )

    def encoded(texts: list[str], *flags: str) -> list[list[int]]:
        done = lab.run_module(
            python,
            "extproc.tokenizer_probe",
            "encode",
            str(directory),
            *flags,
            stdin=json.dumps(texts),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    [chat_ids] = encoded([text])
    [completion_ids] = encoded([prompt], "--special")
    routing = RoutingConfig()
    translation = cache_events.load_translation(
        directory, lab.SERVED_MODEL_NAME, routing.block_size_bytes, routing.max_blocks
    )
    assert translation.tokens.prepend == prepend
    for api, ids, body in (
        ("chat", chat_ids, {"messages": messages}),
        ("completions", completion_ids, {"prompt": prompt}),
    ):
        table = cache_events.EndpointCacheEvents(translation)
        event = stored_event(ids, 0, len(ids) // lab.BLOCK_SIZE, lab.BLOCK_SIZE)
        announced = [h for held, hashes in table.apply([event]) if held for h in hashes]
        expected = _router_hashes(api, body)
        print(
            f"{version} ({prepend}) {api}: {len(ids)} tokens, {len(announced)} router blocks "
            f"announced of {len(expected)}, untranslated {table.untranslated}"
        )
        assert table.untranslated == 0
        assert announced == expected[: len(announced)]
        # All but the router blocks in the tokens past the last whole vLLM block.
        assert len(announced) >= len(expected) - 3


def test_vllms_events_of_a_salted_chat_translate_with_its_salt(
    vllm_with_events: EventsServer,
) -> None:
    """A chat with a ``cache_salt``: vLLM hashes its first block with the salt and publishes
    it among that block's extra keys; the events translate into the router hashes of the
    next turn with the same salt, reply included (and not into the unsalted ones)."""
    address = vllm_with_events.address
    messages = [
        {"role": "system", "content": "You keep each tenant's cache apart. " * 10},
        {"role": "user", "content": "Which blocks can another tenant reuse? " * 5},
    ]
    with _listening(vllm_with_events) as (translator, subscriber):
        body = {
            "model": lab.SERVED_MODEL_NAME,
            "messages": messages,
            "max_tokens": 96,
            "temperature": 0,
            "cache_salt": "tenant-7",
        }
        request = urllib.request.Request(
            f"http://{address}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.load(response)["choices"][0]["message"]["content"]
        received = _read_events(subscriber)
    first_keys = [
        event.get("extra_keys")
        for frames in received[:1]
        for event in cache_events.decode_message(frames)[1]
        if isinstance(event, dict) and event.get("type") == "BlockStored"
    ]
    announced = _translated(translator, received)

    def next_turn(salt: str) -> list[int]:
        payload: dict[str, object] = {"messages": _then(messages, reply, "Go on.")}
        if salt:
            payload["cache_salt"] = salt
        return _router_hashes("chat", payload, salt)

    expected = next_turn("tenant-7")
    print(
        f"first stored event's extra keys {str(first_keys)[:80]}; {len(announced)} router "
        f"blocks announced of the next turn's {len(expected)} (the first turn "
        f"{_router_blocks(messages)}); untranslated vLLM blocks {translator.untranslated}"
    )
    assert translator.untranslated == 0
    assert announced == expected[: len(announced)] and len(announced) > _router_blocks(messages)
    assert announced[:4] != next_turn("")[:4]


ADAPTER = "tiny-lora"


def test_a_lora_adapters_events_translate_to_its_own_router_hashes(
    vllm_with_events: EventsServer, tmp_path: Path
) -> None:
    """vLLM keys a LoRA adapter's cached blocks by the adapter's name (a request for the
    base model cannot reuse them, nor the adapter the base model's) and publishes the name
    with every block. A second vLLM serves the tiny model with an adapter
    (``--lora-modules``): the same conversation sent to the base model and to the adapter
    is stored twice, and each translates into its own next turn's router hashes (rooted at
    the model name the client sent), replies included. A router behind Envoy reading those
    events matches the adapter's next turn, which it never saw, and nothing of the same
    turn sent to the base model."""
    model_dir = vllm_with_events.model_dir
    adapter = lab.lora_adapter(lab.ensure_vllm_env(), model_dir, tmp_path / "lora")
    messages = [
        {"role": "system", "content": "You speak for one fine-tuned adapter. " * 8},
        {"role": "user", "content": "Whose cache does an adapter's request use? " * 4},
    ]
    args = [
        *("--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}"),
        *("--max-lora-rank", "8", "--max-loras", "1"),
    ]
    with _another_server("vllm-lora", tmp_path, model_dir, args) as served:
        address = served.address
        with _listening(served) as (table, subscriber):
            base_reply = _chat(address, messages)
            base = _translated(table, _read_events(subscriber))
            reply = _chat(address, messages, ADAPTER)
            received = _read_events(subscriber)
            adapted = _translated(table, received)
        names = {
            event.get("lora_name")
            for frames in received
            for event in cache_events.decode_message(frames)[1]
            if isinstance(event, dict) and event.get("type") == "BlockStored"
        }
        with Stack() as stack:
            args = [*served.router_args(), "--set", "cache_events.replay="]
            admin, envoy = _router_behind_envoy(stack, address, args)
            _post(address, "/reset_prefix_cache")
            following = _then(messages, _chat(address, messages, ADAPTER), "Go on.")
            _wait_for_count(admin, "stored_blocks", _router_blocks(messages))
            decision = _routed_through(envoy, admin, following, ADAPTER)
            as_base = _routed_through(envoy, admin, following)
            counts = _cache_event_counts(admin)
    first_turn = _router_blocks(messages)
    expected = _router_hashes("chat", {"messages": _then(messages, reply, "Go on.")}, "", ADAPTER)
    expected_base = _router_hashes("chat", {"messages": _then(messages, base_reply, "Go on.")})
    print(
        f"lora names {names}; base: {len(base)} router blocks announced, adapter: "
        f"{len(adapted)} (first turn {first_turn}; replies {base_reply[:20]!r}, "
        f"{reply[:20]!r}); untranslated {table.untranslated}; through Envoy, the adapter's "
        f"next turn {_matched(decision)}, the base model's {_matched(as_base)}; {counts}"
    )
    assert names == {ADAPTER}
    assert table.untranslated == 0
    # Stored twice, each chain its own model's: vLLM reused nothing across them.
    assert base == expected_base[: len(base)] and len(base) > first_turn
    assert adapted == expected[: len(adapted)] and len(adapted) > first_turn
    assert not set(adapted) & set(base)
    assert decision["matched_blocks"] > first_turn, (decision, counts)
    assert as_base["matched_blocks"] == 0, (as_base, counts)


def test_an_adapter_vllm_loads_at_run_time_is_routed_to_its_server(
    vllm_with_events: EventsServer, tmp_path: Path
) -> None:
    """Real vLLM's ``/v1/load_lora_adapter`` on one of two servers behind Envoy and one
    router whose rounds of the model lists are an hour apart: the adapter's first request
    names a model no list read names, so the router reads every list again at once (that
    read is the only way it can learn the adapter within the test) and the request waits
    for it (``models.unknown_wait_seconds``): every request for the adapter, the first
    included, reaches the server that loaded it (before, the first ones, while both lists
    named one model, went by their prefix to either server, the other answering 404);
    the base model's still route. Unloaded, the adapter's request gets vLLM's 404, a
    clear answer, from the server that listed it, and that 404 has its list read again
    (the adapter no longer listed). (The stand-in replica's copy of the API:
    tests/integration/test_model_pools.py.)"""
    base = vllm_with_events.address
    model_dir = vllm_with_events.model_dir
    adapter = lab.lora_adapter(lab.ensure_vllm_env(), model_dir, tmp_path / "lora")
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    runtime = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    name = "runtime-lora"
    with _another_server("vllm-lora-runtime", tmp_path, model_dir, args, runtime) as served:
        lora = served.address
        with Stack() as stack:
            router, _ = stack.start_router(
                [base, lora],
                # (the longest wait the configs allow: a busy shared machine answers slowly)
                extra_args=[
                    "--set",
                    "models.interval_seconds=3600",
                    "--set",
                    "models.unknown_wait_seconds=0.9",
                ],
                ready=True,
            )
            envoy, _ = stack.start_proxy("override-host", [base, lora], router)
            admin = stack.router_admin_ports["router"]
            both = {(base, lab.SERVED_MODEL_NAME), (lora, lab.SERVED_MODEL_NAME)}
            assert wait_until(lambda: models_known(admin) == both, 30), models_known(admin)
            load = {"lora_name": name, "lora_path": str(adapter)}
            assert _post(lora, "/v1/load_lora_adapter", load) == 200
            first = _sent_through(envoy, admin, name, 0)  # names a model no list names
            waited = _decisions(admin)[0].get("list_wait_ms")
            print(f"the adapter's first request: {first}, after {waited} ms for the lists")
            assert first == (200, "routed", lora, "listed"), first  # (it waited for the read)
            after = [_sent_through(envoy, admin, name, 100 + k) for k in range(5)]
            assert after == [(200, "routed", lora, "")] * 5, after
            assert wait_until(lambda: (lora, name) in models_known(admin), 10)  # (gauges: 1 s)
            for k in range(3):
                status, outcome, endpoint, _ = _sent_through(envoy, admin, lab.SERVED_MODEL_NAME, k)
                assert (status, outcome) == (200, "routed") and endpoint in (base, lora)
            assert _post(lora, "/v1/unload_lora_adapter", {"lora_name": name}) == 200
            gone = _sent_through(envoy, admin, name, 200)
            print(f"after it was unloaded: {gone}")
            assert gone == (404, "routed", lora, ""), gone
            # That 404 (vLLM's to a model its list named) has its list read again: with the
            # rounds an hour apart, only that read can drop the adapter within the test.
            assert wait_until(lambda: (lora, name) not in models_known(admin), 10)


def _sent_through(
    envoy_port: int, admin_port: int, model: str, k: int
) -> tuple[int, str, str, str]:
    """A short chat for ``model`` through Envoy: its status, the router's outcome for it,
    the endpoint it routed it to ("" when it passed it through) and how its wait for the
    model lists read again ended ("" when it did not wait)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Question {k} for a pool of one. " * 6}],
        "max_tokens": 4,
    }
    request = urllib.request.Request(
        f"http://{LOOPBACK}:{envoy_port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )

    def send() -> int:
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    status, record = _decided(admin_port, send)
    endpoint = record.get("decision", {}).get("endpoint", "")
    return status, record["outcome"], endpoint, record.get("list_wait", "")


def _decided(admin_port: int, send: Callable[[], T]) -> tuple[T, dict]:
    """What ``send()`` returned, and the router's record of the request it sent: the newest
    once a new one shows (the log is a bounded ring: a longer list cannot tell, and the
    record is written when the stream ends, just after the reply)."""
    newest = _decisions(admin_port)[:1]
    result = send()
    assert wait_until(lambda: _decisions(admin_port)[:1] != newest, 30), "no decision"
    return result, _decisions(admin_port)[0]


def _decisions(admin_port: int) -> list[dict]:
    url = f"http://{LOOPBACK}:{admin_port}/debug/decisions?limit=1"
    return orjson.loads(urllib.request.urlopen(url, timeout=10).read())["decisions"]


def _cache_event_counts(admin_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{LOOPBACK}:{admin_port}/metrics", timeout=10).read()
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if sample.name == "prefix_router_cache_events_total"
    }


def _router_behind_envoy(stack: Stack, address: str, args: list[str]) -> tuple[int, int]:
    """A router reading the server's events behind a real Envoy: (admin port, Envoy port)."""
    router, _ = stack.start_router([address], extra_args=args, ready=True)
    envoy, _ = stack.start_proxy("override-host", [address], router)
    time.sleep(1.0)  # the subscriber joins within its first reconcile
    return stack.router_admin_ports["router"], envoy


def _then(messages: list[dict[str, str]], reply: str, question: str) -> list[dict[str, str]]:
    """The conversation's next turn: the reply, then a new question."""
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]


def _router_hashes(
    api: str, payload: dict[str, object], salt: str = "", model: str = lab.SERVED_MODEL_NAME
) -> list[int]:
    """The router's block hashes of a request (``payload``: its body but the model)."""
    routing = RoutingConfig()
    body = orjson.dumps({"model": model, **payload})
    root = root_hash(model, salt)
    prompt = parse_request(api, body).prompt
    return block_hashes(prompt, root, routing.block_size_bytes, routing.max_blocks).tolist()


def _router_blocks(messages: list[dict[str, str]]) -> int:
    """The router's whole blocks in a conversation's canonical prompt."""
    body = orjson.dumps({"model": lab.SERVED_MODEL_NAME, "messages": messages})
    return len(parse_request("chat", body).prompt) // RoutingConfig().block_size_bytes


def _matched(decision: dict) -> str:
    return f"{decision['matched_blocks']} of {decision['total_blocks']} blocks matched"


def _wait_for_count(admin_port: int, kind: str, at_least: float) -> None:
    deadline = time.monotonic() + 60
    while _cache_event_counts(admin_port).get(kind, 0) < at_least:
        assert time.monotonic() < deadline, _cache_event_counts(admin_port)
        time.sleep(0.25)


def _wait_until_settled(admin_port: int, quiet_seconds: float = 1.0) -> None:
    """Until the router's event counters stop moving: a replay of vLLM's buffer (every
    earlier test's messages too) takes a while after its first message is counted."""
    deadline = time.monotonic() + 60
    last, since = _cache_event_counts(admin_port), time.monotonic()
    while time.monotonic() - since < quiet_seconds:
        assert time.monotonic() < deadline, last
        time.sleep(0.2)
        now = _cache_event_counts(admin_port)
        if now != last:
            last, since = now, time.monotonic()


def _routed_through(
    envoy_port: int,
    admin_port: int,
    messages: list[dict[str, str]] | str,
    model: str = lab.SERVED_MODEL_NAME,
) -> dict:
    """Send a conversation (or a completions prompt) through Envoy; the router's decision."""
    address = f"{LOOPBACK}:{envoy_port}"
    if isinstance(messages, str):
        _, record = _decided(admin_port, lambda: _complete(address, messages))
    else:
        _, record = _decided(admin_port, lambda: _chat(address, messages, model))
    assert record["outcome"] == "routed", record
    return record["decision"]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_router_learns_from_vllms_events_what_another_router_placed(
    vllm_with_events: EventsServer, api: str
) -> None:
    """A real router behind a real Envoy reads vLLM's events: a conversation whose first
    turn reached vLLM without it (as another router replica would send it) is matched on
    its next turn, the reply's blocks included; so is a completions prompt carried on
    (prompt, reply, more). Without the events the router has never seen either and matches
    nothing."""
    address = vllm_with_events.address
    messages = [
        {"role": "system", "content": "You route requests to warm caches. " * 10},
        {"role": "user", "content": "What does a router learn from events? " * 5},
    ]
    prompt = "Completions carry their whole context in one prompt string. " * 8
    with Stack() as stack:
        # Subscribing only: the replay socket is the next test's.
        args = [*vllm_with_events.router_args(), "--set", "cache_events.replay="]
        admin, envoy = _router_behind_envoy(stack, address, args)
        # Chains cached before it joined would extend parents it never saw (no replay here).
        _post(address, "/reset_prefix_cache")
        # Straight to vLLM, not through this router; then the next request through it.
        if api == "chat":
            following: list[dict[str, str]] | str = _then(
                messages, _chat(address, messages), "Go on."
            )
            sent_blocks, announced_at_least = _router_blocks(messages), 10
        else:
            following = prompt + _complete(address, prompt) + " And then?"
            sent_blocks = len(prompt.encode()) // RoutingConfig().block_size_bytes
            announced_at_least = 5
        _wait_for_count(admin, "stored_blocks", announced_at_least)
        decision = _routed_through(envoy, admin, following)
        counts = _cache_event_counts(admin)
        print(f"{api}, next request: {_matched(decision)}; {counts}")
        assert decision["matched_blocks"] > sent_blocks, (decision, counts)
        assert decision["endpoint"] == address


def test_a_router_that_subscribes_late_replays_what_vllm_published_before(
    vllm_with_events: EventsServer,
) -> None:
    """A conversation's first turn is cached (and announced) before the router starts; its
    second turn, sent straight to vLLM, extends that chain. The router asks vLLM's replay
    socket for the earlier messages, so the second turn translates (its parent is known)
    and the third turn, through Envoy, matches all of the second on that replica. Without
    the replay the second turn's blocks extend a parent it never saw: none would translate."""
    address = vllm_with_events.address
    messages = [
        {"role": "system", "content": "You explain replays of missed messages. " * 10},
        {"role": "user", "content": "Which messages does a late subscriber miss? " * 4},
    ]
    _post(address, "/reset_prefix_cache")
    first = _chat(address, messages)  # published with nobody listening
    second_turn = _then(messages, first, "Why?")
    with Stack() as stack:
        admin, envoy = _router_behind_envoy(stack, address, vllm_with_events.router_args())
        second = _chat(address, second_turn)  # straight to vLLM: extends the first chain
        _wait_for_count(admin, "replayed_messages", 1)
        _wait_until_settled(admin)
        decision = _routed_through(envoy, admin, _then(second_turn, second, "Thanks."))
        counts = _cache_event_counts(admin)
        print(f"third turn: {_matched(decision)}; {counts}")
        assert counts.get("untranslated_blocks", 0) == 0, counts
        assert decision["matched_blocks"] >= _router_blocks(second_turn), (decision, counts)
