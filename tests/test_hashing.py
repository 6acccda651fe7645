"""Block hashes: stable, prefix-identifying, seeded by model and salt, capped."""

from extproc.hashing import (
    block_hashes,
    block_hashes_after,
    group_key,
    placement_key,
    root_hash,
)
from extproc.prompt import LLMRequest


def test_hashes_are_stable_across_calls_and_processes():
    # Fixed value: a change here silently invalidates every deployed index.
    assert root_hash("m", "") == root_hash("m")
    assert block_hashes(b"a" * 128, root_hash("m"), 64, 10).tolist() == [
        17616319852280181250,
        10351618823602915694,
    ]
    assert len({root_hash("m"), root_hash("n"), root_hash("m", "salt")}) == 3


def test_equal_prefixes_share_leading_hashes_only():
    root = root_hash("m")
    a = block_hashes(b"x" * 64 + b"y" * 64 + b"z" * 64, root, 64, 10)
    b = block_hashes(b"x" * 64 + b"y" * 64 + b"w" * 64, root, 64, 10)
    assert a[:2].tolist() == b[:2].tolist() and a[2] != b[2]


def test_position_and_history_matter():
    root = root_hash("m")
    a = block_hashes(b"x" * 64 + b"y" * 64, root, 64, 10)
    b = block_hashes(b"y" * 64 + b"y" * 64, root, 64, 10)
    c = block_hashes(b"y" * 64 + b"x" * 64, root, 64, 10)
    assert a[1] != b[1]  # same block content, different history
    assert a[1] != c[1]  # the same blocks in another order
    assert b[0] != b[1]  # a repeated block is not the same prefix


def test_hashes_agree_with_their_definition():
    from xxhash import xxh3_64_intdigest

    from extproc.hashing import _multipliers

    prompt = bytes(range(256)) * 3
    root = root_hash("m", "salt")
    expected, value = [], root
    for i in range(len(prompt) // 64):
        block = xxh3_64_intdigest(prompt[i * 64 : (i + 1) * 64])
        value ^= (block * int(_multipliers(1024)[i])) % 2**64
        expected.append(value)
    assert block_hashes(prompt, root, 64, 1024).tolist() == expected
    assert block_hashes(prompt, root, 64, 5).tolist() == expected[:5]


def test_only_full_blocks_and_the_cap():
    root = root_hash("m")
    assert block_hashes(b"x" * 63, root, 64, 10).tolist() == []
    assert len(block_hashes(b"x" * 130, root, 64, 10)) == 2
    assert len(block_hashes(b"x" * 6400, root, 64, 10)) == 10


def test_models_never_share_blocks():
    assert (
        block_hashes(b"x" * 64, root_hash("a"), 64, 1)[0]
        != block_hashes(b"x" * 64, root_hash("b"), 64, 1)[0]
    )


def _request(prompt: bytes, first_turn_end: int, preamble_end: int = 0) -> LLMRequest:
    return LLMRequest("chat", "m", "", prompt, first_turn_end, False, preamble_end)


def test_group_key_is_the_preamble_when_it_is_most_of_the_first_turn():
    root = root_hash("m")

    def key(system: bytes, question: bytes, mode: str = "first_turn") -> int:
        prompt = system + question
        request = _request(prompt, len(prompt), len(system))
        return group_key(request, block_hashes(prompt, root, 64, 100), 64, mode, 0.5)

    document = b"d" * 1000
    # Two questions on one document: one key, its preamble's last full block's hash.
    assert key(document, b"first question") == key(document, b"another one") != 0
    assert key(document, b"q") == block_hashes(document, root, 64, 100)[1000 // 64 - 1]
    assert key(b"e" * 1000, b"q") != key(document, b"q")
    assert key(b"s" * 200, b"u" * 800) == 0  # a short preamble: the session's own key
    assert key(b"", b"u" * 800) == 0  # none
    assert key(b"s" * 30, b"u") == 0  # not one full block
    assert key(document, b"q", mode="blocks") == 0


def test_placement_key_is_the_same_for_every_turn_of_a_conversation():
    root = root_hash("m")
    first = b"s" * 300 + b"u" * 100
    turn1, turn2 = first, first + b"a" * 500 + b"u" * 200
    keys = [
        placement_key(
            _request(p, len(first)), block_hashes(p, root, 64, 100), root, 64, "first_turn", 4
        )
        for p in (turn1, turn2)
    ]
    assert keys[0] == keys[1]
    other = b"s" * 300 + b"v" * 100
    other_key = placement_key(
        _request(other, len(other)), block_hashes(other, root, 64, 100), root, 64, "first_turn", 4
    )
    assert other_key != keys[0]


def test_placement_key_by_blocks_and_for_short_prompts():
    root = root_hash("m")
    p = b"q" * 64 * 8
    key = placement_key(_request(p, 0), block_hashes(p, root, 64, 100), root, 64, "blocks", 4)
    assert key == block_hashes(p, root, 64, 100)[3]
    short = placement_key(_request(b"hi", 2), [], root, 64, "first_turn", 4)
    assert short != placement_key(_request(b"ho", 2), [], root, 64, "first_turn", 4)


def test_hashes_after_a_block_continue_the_chain_exactly() -> None:
    prompt = bytes(range(256)) * 20
    root = root_hash("m")
    whole = block_hashes(prompt, root, 64, 70)
    for start in (0, 1, 33, 69):
        previous = int(whole[start - 1]) if start else root
        assert (
            block_hashes_after(prompt, previous, start, 64, 70).tolist() == whole[start:].tolist()
        )
    assert len(block_hashes_after(prompt, root, 70, 64, 70)) == 0  # the window is full
    assert block_hashes_after(prompt, 12345, 5, 64, 70).tolist() != whole[5:].tolist()
