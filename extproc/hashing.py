"""Chained xxh3_64 block hashes of a canonical prompt.

Block i's hash is seeded by block i-1's, so equal hashes at position i mean equal prefixes
(up to collisions of a 64-bit hash). The root seed mixes in the model name and cache salt,
so two models, or two tenants with different salts, never share a prefix.
Only full blocks are hashed: model servers cache only full blocks too.
"""

from __future__ import annotations

from xxhash import xxh3_64_intdigest

from .prompt import LLMRequest


def root_hash(model: str, cache_salt: str = "") -> int:
    return xxh3_64_intdigest(
        b"prefix-router/v1\x00" + model.encode() + b"\x00" + cache_salt.encode()
    )


def block_hashes(prompt: bytes, root: int, block_size: int, max_blocks: int) -> list[int]:
    """Hashes of the first min(len // block_size, max_blocks) full blocks."""
    count = min(len(prompt) // block_size, max_blocks)
    view = memoryview(prompt)
    hashes = [0] * count
    previous = root
    for i in range(count):
        start = i * block_size
        previous = xxh3_64_intdigest(view[start : start + block_size], previous)
        hashes[i] = previous
    return hashes


def session_blocks(
    request: LLMRequest, hashes: list[int], block_size: int, mode: str, cold_start_blocks: int
) -> int:
    """How many leading blocks identify the request's session (the placement-key prefix).

    An endpoint holding fewer than this many blocks shares only a common preamble (say, a
    system prompt used by every conversation) with the request, not the session itself.
    """
    if mode == "first_turn" and request.first_turn_end:
        return min(max(1, request.first_turn_end // block_size), len(hashes))
    return min(cold_start_blocks, len(hashes))


def placement_key(
    request: LLMRequest,
    hashes: list[int],
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
    if mode == "first_turn" and request.first_turn_end:
        full_blocks = request.first_turn_end // block_size
        if full_blocks == 0:
            return xxh3_64_intdigest(request.prompt[: request.first_turn_end], root)
        if hashes:
            return hashes[min(full_blocks, len(hashes)) - 1]
    if hashes:
        return hashes[min(cold_start_blocks, len(hashes)) - 1]
    return xxh3_64_intdigest(request.prompt, root)
