"""Workloads as lists of SimRequest: the Mooncake trace and the peers' shared-prefix shapes.

A request's prompt is a chain of chunk ids, ``chunk_tokens`` tokens each except the last
(``last_tokens``). Ids are chained: an id always follows the same predecessor, so equal ids
mean equal prefixes. Generators use 16-token chunks (the model server's KV block) and round
lengths up to whole chunks; the Mooncake trace brings its own 512-token ids.
"""

from __future__ import annotations

import inspect
import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
GEN_CHUNK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    ids: tuple[int, ...]
    chunk_tokens: int
    last_tokens: int
    # Tokens up to the end of the first user turn (0: not a chat request). Lets our router
    # key cold-start placement per conversation, as it does for real chat bodies.
    first_turn_tokens: int = 0
    session: int = -1
    # Tokens of the messages before the first user turn (a chat request's system prompt).
    preamble_tokens: int = 0
    # Chunk ids of its reply as the session's next request carries it (chat workloads;
    # empty: nobody reuses the reply). A replica that caches output blocks, as vLLM v1
    # caches every full block a sequence computes, holds them after the request ends.
    output_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[SimRequest]
    params: dict[str, Any]
    # A trace: the same requests whatever the seed (a generated workload is drawn from it).
    # The seed then renames the replicas instead (PolicyContext.labelling).
    fixed: bool = False


def load_mooncake(path: str | Path, speedup: float = 1.0, limit: int | None = None) -> Workload:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (512 tokens)."""
    requests = []
    with open(path) as handle:
        for line in itertools.islice(handle, limit):
            if not line.strip():
                continue
            row = json.loads(line)
            ids = tuple(int(i) for i in row["hash_ids"])
            tokens = int(row["input_length"])
            last = tokens - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)
            if not ids or not 0 < last <= MOONCAKE_BLOCK_TOKENS:
                raise ValueError(f"{path}: line {len(requests) + 1}: hash_ids/input_length")
            requests.append(
                SimRequest(
                    rid=len(requests),
                    arrival_s=float(row["timestamp"]) / 1000.0 / speedup,
                    input_tokens=tokens,
                    output_tokens=max(1, int(row["output_length"])),
                    ids=ids,
                    chunk_tokens=MOONCAKE_BLOCK_TOKENS,
                    last_tokens=last,
                )
            )
    requests.sort(key=lambda r: (r.arrival_s, r.rid))
    return Workload(Path(path).name, requests, {"trace": str(path), "speedup": speedup}, fixed=True)


def _chunks(tokens: int) -> int:
    return max(1, -(-tokens // GEN_CHUNK_TOKENS))


def _generated(
    rid: int, arrival_s: float, ids: tuple[int, ...], output_tokens: int, **fields: Any
) -> SimRequest:
    """A generated request: whole GEN_CHUNK_TOKENS chunks, the last one too."""
    return SimRequest(
        rid=rid,
        arrival_s=arrival_s,
        input_tokens=len(ids) * GEN_CHUNK_TOKENS,
        output_tokens=output_tokens,
        ids=ids,
        chunk_tokens=GEN_CHUNK_TOKENS,
        last_tokens=GEN_CHUNK_TOKENS,
        **fields,
    )


def shared_prefix(
    groups: int,
    prompts: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    rate: float,
    requests: int,
    seed: int = 0,
    name: str = "shared-prefix",
    chat: bool = False,
) -> Workload:
    """inference-perf ``shared_prefix`` shape: groups × prompts, each prompt = the group's
    system prompt + its own question; requests pick a (group, prompt) uniformly at random,
    Poisson arrivals at ``rate`` req/s (the GAIE benchmarks replay this for a duration).
    ``chat``: sent as chat requests (system message + user message) instead of completions,
    so each request is a conversation's first turn whose preamble is the group's prompt."""
    rng = random.Random(seed)
    counter = itertools.count()
    sys_chunks, q_chunks = _chunks(system_tokens), _chunks(question_tokens)
    systems = [tuple(next(counter) for _ in range(sys_chunks)) for _ in range(groups)]
    questions = [
        [tuple(next(counter) for _ in range(q_chunks)) for _ in range(prompts)]
        for _ in range(groups)
    ]
    out, now = [], 0.0
    for rid in range(requests):
        now += rng.expovariate(rate)
        g, p = rng.randrange(groups), rng.randrange(prompts)
        ids = systems[g] + questions[g][p]
        out.append(
            _generated(
                rid,
                now,
                ids,
                output_tokens,
                session=g * prompts + p,
                first_turn_tokens=len(ids) * GEN_CHUNK_TOKENS if chat else 0,
                preamble_tokens=sys_chunks * GEN_CHUNK_TOKENS if chat else 0,
            )
        )
    params = {
        "kind": "shared_prefix",
        "groups": groups,
        "prompts": prompts,
        "system_tokens": sys_chunks * GEN_CHUNK_TOKENS,
        "question_tokens": q_chunks * GEN_CHUNK_TOKENS,
        "output_tokens": output_tokens,
        "rate": rate,
        "requests": requests,
        "chat": chat,
    }
    return Workload(name, out, params)


def multi_turn(
    sessions: int,
    turns: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    think_s: float,
    rate: float,
    system_prompts: int = 1,
    seed: int = 0,
    name: str = "multi-turn",
) -> Workload:
    """Chat sessions sharing a system prompt; turn t's prompt = system + every earlier
    (question, answer) + the new question. Sessions start as a Poisson process at ``rate``/s;
    open loop: the next turn comes an exponential think time (mean ``think_s``) plus the
    answer's nominal decode time (10 ms/token) after the previous one."""
    rng = random.Random(seed)
    counter = itertools.count()
    sys_chunks = _chunks(system_tokens)
    q_chunks, a_chunks = _chunks(question_tokens), _chunks(output_tokens)
    systems = [tuple(next(counter) for _ in range(sys_chunks)) for _ in range(system_prompts)]
    pending: list[tuple[float, int, int, tuple[int, ...], int, tuple[int, ...]]] = []
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(rate)
        history = systems[rng.randrange(system_prompts)]
        first_turn = 0
        at = start
        for t in range(turns):
            ids = history + tuple(next(counter) for _ in range(q_chunks))
            if t == 0:
                first_turn = len(ids) * GEN_CHUNK_TOKENS
            answer = tuple(next(counter) for _ in range(a_chunks))
            pending.append((at, s, t, ids, first_turn, answer))
            history = ids + answer
            at += rng.expovariate(1.0 / think_s) + output_tokens * 0.010
    pending.sort()
    out = [
        _generated(
            rid,
            at,
            ids,
            output_tokens,
            first_turn_tokens=first_turn,
            session=s,
            preamble_tokens=sys_chunks * GEN_CHUNK_TOKENS,
            output_ids=answer,
        )
        for rid, (at, s, _t, ids, first_turn, answer) in enumerate(pending)
    ]
    params = {
        "kind": "multi_turn",
        "sessions": sessions,
        "turns": turns,
        "system_prompts": system_prompts,
        "system_tokens": sys_chunks * GEN_CHUNK_TOKENS,
        "question_tokens": q_chunks * GEN_CHUNK_TOKENS,
        "output_tokens": a_chunks * GEN_CHUNK_TOKENS,
        "think_s": think_s,
        "rate": rate,
    }
    return Workload(name, out, params)


def session_rounds(
    groups: int,
    sessions: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    rate: float,
    requests: int,
    question_std: float = 0.0,
    output_std: float = 0.0,
    seed: int = 0,
    name: str = "session-rounds",
) -> Workload:
    """inference-perf ``shared_prefix`` with ``enable_multi_turn_chat`` (the GAIE multi-chat
    benchmarks): ``groups`` × ``sessions`` user sessions, each starting from its group's
    system prompt, taken in a shuffled order, one request each, round after round: request i
    continues session i mod (groups × sessions) with every earlier question and answer plus a
    new question. Sent as completions (the context is one string), so the router sees no
    turns. Lengths are normal(mean, std) clipped to 1..10,000 tokens, as inference-perf
    draws them; Poisson arrivals at ``rate`` req/s."""
    rng = random.Random(seed)
    counter = itertools.count()
    sys_chunks = _chunks(system_tokens)
    systems = [tuple(next(counter) for _ in range(sys_chunks)) for _ in range(groups)]
    order = list(range(groups * sessions))
    rng.shuffle(order)
    context = {s: systems[s // sessions] for s in order}

    def draw(mean: float, std: float) -> int:
        return int(min(10_000, max(1, round(rng.gauss(mean, std) if std else mean))))

    out, now = [], 0.0
    for rid in range(requests):
        now += rng.expovariate(rate)
        session = order[rid % len(order)]
        ids = context[session] + tuple(
            next(counter) for _ in range(_chunks(draw(question_tokens, question_std)))
        )
        output = draw(output_tokens, output_std)
        answer = tuple(next(counter) for _ in range(_chunks(output)))
        out.append(_generated(rid, now, ids, output, session=session, output_ids=answer))
        context[session] = ids + answer
    params = {
        "kind": "session_rounds",
        "groups": groups,
        "sessions": sessions,
        "system_tokens": sys_chunks * GEN_CHUNK_TOKENS,
        "question_tokens": question_tokens,
        "question_std": question_std,
        "output_tokens": output_tokens,
        "output_std": output_std,
        "rate": rate,
        "requests": requests,
    }
    return Workload(name, out, params)


@dataclass(frozen=True)
class Preset:
    """A generator with some of its parameters fixed; the CLI may override those it takes."""

    generator: Callable[..., Workload]
    fixed: dict[str, Any]

    @property
    def takes(self) -> frozenset[str]:
        return frozenset(inspect.signature(self.generator).parameters) - {"seed", "name"}

    def __call__(self, **overrides: Any) -> Workload:
        return self.generator(
            **{**self.fixed, **{k: v for k, v in overrides.items() if v is not None}}
        )


def _preset_shared(**fixed: Any) -> Preset:
    return Preset(shared_prefix, fixed)


def _preset_chat(**fixed: Any) -> Preset:
    return Preset(multi_turn, fixed)


# GAIE high-cache (2025-11): 256 groups x 16 prompts, system 2,048, question 256, out 256.
_GAIE_HIGH_CACHE: dict[str, Any] = dict(
    groups=256,
    prompts=16,
    system_tokens=2048,
    question_tokens=256,
    output_tokens=256,
    rate=60.0,
    requests=8192,
)

# Shapes from /work/shared/workloads/README.md (the peers' published benchmark configs);
# rates are ours, chosen to load 8 simulated H200 replicas without saturating them.
PRESETS: dict[str, Preset] = {
    "gaie-high-cache": _preset_shared(name="gaie-high-cache", **_GAIE_HIGH_CACHE),
    # The same sent as chat requests (the document a system message, the question a user
    # message), as a chat client or inference-perf's chat API sends it.
    "gaie-high-cache-chat": _preset_shared(
        name="gaie-high-cache-chat", chat=True, **_GAIE_HIGH_CACHE
    ),
    # GAIE low-cache (2025-11): system 256, question 2,048.
    "gaie-low-cache": _preset_shared(
        name="gaie-low-cache",
        groups=256,
        prompts=16,
        system_tokens=256,
        question_tokens=2048,
        output_tokens=256,
        rate=30.0,
        requests=8192,
    ),
    # SGLang generated-shared-prefix default: 64 x 16, system 2,048, question 128, out 256.
    "sglang-shared-prefix": _preset_shared(
        name="sglang-shared-prefix",
        groups=64,
        prompts=16,
        system_tokens=2048,
        question_tokens=128,
        output_tokens=256,
        rate=40.0,
        requests=4096,
    ),
    # A small shared-prefix shape for tests and quick looks.
    "small-shared-prefix": _preset_shared(
        name="small-shared-prefix",
        groups=16,
        prompts=8,
        system_tokens=512,
        question_tokens=64,
        output_tokens=32,
        rate=20.0,
        requests=400,
    ),
    # Multi-turn chat (GAIE multi-chat / vLLM multi-turn shape): one shared system prompt.
    "multi-turn-chat": _preset_chat(
        name="multi-turn-chat",
        sessions=600,
        turns=6,
        system_tokens=1000,
        question_tokens=256,
        output_tokens=256,
        think_s=5.0,
        rate=4.0,
    ),
    "small-multi-turn": _preset_chat(
        name="small-multi-turn",
        sessions=40,
        turns=4,
        system_tokens=256,
        question_tokens=64,
        output_tokens=32,
        think_s=2.0,
        rate=4.0,
    ),
    # Held out: published shapes the scheduler was not tuned on (docs/benchmarks.md,
    # "Held-out workloads"). The llm-d precise prefix-cache guide (the GAIE 2026-06 short
    # questions, many system prompts): 150 x 5, system 6,000, question 1,200, out 1,000.
    "llmd-precise-prefix": _preset_shared(
        name="llmd-precise-prefix",
        groups=150,
        prompts=5,
        system_tokens=6000,
        question_tokens=1200,
        output_tokens=1000,
        rate=20.0,
        requests=4096,
    ),
    # The llm-d tiered prefix-cache guide: 250 x 5, system 16,000, question 256, out 256.
    "llmd-tiered-prefix": _preset_shared(
        name="llmd-tiered-prefix",
        groups=250,
        prompts=5,
        system_tokens=16000,
        question_tokens=256,
        output_tokens=256,
        rate=10.0,
        requests=4096,
    ),
    # GAIE 2026-06 long questions, many system prompts: 150 x 5, system 1,000, question
    # 6,200, out 1,000 (little to share).
    "gaie-long-questions": _preset_shared(
        name="gaie-long-questions",
        groups=150,
        prompts=5,
        system_tokens=1000,
        question_tokens=6200,
        output_tokens=1000,
        rate=20.0,
        requests=4096,
    ),
    # GAIE 2026-06 multi-chat, long questions: 6 system prompts x 1,000 sessions, question
    # 3,000 +- 900, out 1,000 +- 300; two rounds of every session.
    "gaie-multi-chat": Preset(
        session_rounds,
        dict(
            name="gaie-multi-chat",
            groups=6,
            sessions=1000,
            system_tokens=1000,
            question_tokens=3000,
            question_std=900.0,
            output_tokens=1000,
            output_std=300.0,
            rate=10.0,
            requests=12000,
        ),
    ),
}
