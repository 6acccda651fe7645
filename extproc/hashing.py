"""Prefix hashes of a canonical prompt, one per block.

Hash i identifies blocks 0..i: it is the XOR of xxh3_64(block j) x M_j over j <= i and the
root, with M_j a fixed odd multiplier per position, so equal hashes at position i mean equal
prefixes (up to collisions of a 64-bit hash), and a block's position counts (swapping two
blocks changes the hash). This equals a chain of seeded hashes in what it identifies but
runs as one C-level pass over the blocks plus three numpy operations: ~40 us for 32 KiB in
64-byte blocks, where a Python loop of seeded xxh3 calls takes ~90 us (docs/benchmarks.md).
The root mixes in the model name and cache salt, so two models, or two tenants with
different salts, never share a prefix. Only full blocks are hashed: model servers cache
only full blocks too.
"""

from __future__ import annotations

import struct
from functools import lru_cache

import numpy as np
from xxhash import xxh3_64_intdigest

from .prompt import LLMRequest

EMPTY = np.zeros(0, dtype=np.uint64)


def root_hash(model: str, cache_salt: str = "") -> int:
    return xxh3_64_intdigest(
        b"prefix-router/v2\x00" + model.encode() + b"\x00" + cache_salt.encode()
    )


@lru_cache(maxsize=1)
def _multipliers(count: int) -> np.ndarray:
    return np.array(
        [xxh3_64_intdigest(i.to_bytes(4, "little"), 0x9E3779B9) | 1 for i in range(count)],
        dtype=np.uint64,
    )


@lru_cache(maxsize=4096)
def _splitter(block_size: int, count: int) -> struct.Struct:
    return struct.Struct(f"{block_size}s" * count)


def block_hashes(prompt: bytes, root: int, block_size: int, max_blocks: int) -> np.ndarray:
    """Prefix hashes (uint64) of the first min(len // block_size, max_blocks) full blocks."""
    count = min(len(prompt) // block_size, max_blocks)
    if count <= 0:
        return EMPTY
    blocks = _splitter(block_size, count).unpack_from(prompt)
    hashes = np.fromiter(map(xxh3_64_intdigest, blocks), dtype=np.uint64, count=count)
    hashes *= _multipliers(max(count, max_blocks))[:count]
    hashes[0] ^= np.uint64(root)
    np.bitwise_xor.accumulate(hashes, out=hashes)
    return hashes


def block_hashes_after(
    prompt: bytes, previous: int, start: int, block_size: int, max_blocks: int
) -> np.ndarray:
    """block_hashes(prompt, ...)[start:], from ``previous``: the hash of block start - 1
    (the root when start is 0). A chain that grows by a block at a time (a reply being
    generated) then costs its new blocks, not its whole length."""
    count = min(len(prompt) // block_size, max_blocks)
    if count <= start:
        return EMPTY
    blocks = _splitter(block_size, count - start).unpack_from(prompt, start * block_size)
    hashes = np.fromiter(map(xxh3_64_intdigest, blocks), dtype=np.uint64, count=count - start)
    hashes *= _multipliers(max(count, max_blocks))[start:count]
    hashes[0] ^= np.uint64(previous)
    np.bitwise_xor.accumulate(hashes, out=hashes)
    return hashes


def keyed_by_turns(request: LLMRequest, mode: str) -> bool:
    """Whether the session key follows the request's turns (a chat body in 'first_turn'
    mode); otherwise it is the first cold_start_blocks blocks (a completion has no turns)."""
    return mode == "first_turn" and bool(request.first_turn_end)


def session_blocks(
    request: LLMRequest, hashes: np.ndarray, block_size: int, mode: str, cold_start_blocks: int
) -> int:
    """How many leading blocks identify the request's session (the placement-key prefix).

    An endpoint holding fewer than this many blocks shares only a common preamble (say, a
    system prompt used by every conversation) with the request, not the session itself.
    """
    if keyed_by_turns(request, mode):
        return min(max(1, request.first_turn_end // block_size), len(hashes))
    return min(cold_start_blocks, len(hashes))


def placement_key(
    request: LLMRequest,
    hashes: np.ndarray,
    root: int,
    block_size: int,
    mode: str,
    cold_start_blocks: int,
) -> int:
    """The key that rendezvous hashing places a new prefix by.

    It must be the same for every request of one conversation, so that independent router
    replicas, each with an empty index, still send all its turns to one endpoint:
    'first_turn' keys on the prompt up to the end of the first user turn, 'blocks' on the
    first ``cold_start_blocks`` blocks (and first_turn falls back to that without turns).
    """
    if keyed_by_turns(request, mode):
        full_blocks = request.first_turn_end // block_size
        if full_blocks == 0:
            return xxh3_64_intdigest(request.prompt[: request.first_turn_end], root)
        if len(hashes):
            return int(hashes[min(full_blocks, len(hashes)) - 1])
    if len(hashes):
        return int(hashes[min(cold_start_blocks, len(hashes)) - 1])
    return xxh3_64_intdigest(request.prompt, root)


def group_key(
    request: LLMRequest, hashes: np.ndarray, block_size: int, mode: str, fraction: float
) -> int:
    """The key a new conversation is placed by when its preamble (system prompt, tools) is
    at least ``fraction`` of its first turn, else 0 (none): the hash of the preamble's full
    blocks. Questions on one long document, or conversations of one agent, then meet on
    one endpoint whichever router replica places them, where a key that takes in the
    question sends each to a different endpoint and copies the document to all of them.
    (Scheduler.pick places by the session key instead once the preamble draws more than
    one endpoint's share of the new sessions.)"""
    if not keyed_by_turns(request, mode) or not request.preamble_end:
        return 0
    blocks = min(request.preamble_end // block_size, len(hashes))
    if not blocks or request.preamble_end < fraction * request.first_turn_end:
        return 0
    return int(hashes[blocks - 1])
