"""vLLM's KV-cache events as block hashes of this router's, with no tokeniser on the hot path.

vLLM announces every block it computes (``BlockStored``: a chain of its block hashes with
their token ids, after the chat template) and every block it evicts (``BlockRemoved``).
The router hashes a request's canonical bytes (prompt.py), and tokenising each prompt as
the model server does to meet vLLM's hashes would not fit the hot path: a byte-level BPE
encode of 32 KiB took ~8 ms here (docs/benchmarks.md), against a budget under 1 ms. So the
translation runs the other way, off the hot path: a stored chain's token ids decode to the
exact text the server rendered (byte-level BPE decodes byte for byte; SentencePiece-style
BPE with a space where its tokeniser put a "▁" the text did not have, which the template's
layout is learnt with, TokenBytes.as_tokenized), the chat template's
layout, learnt at start-up by rendering probe conversations, splits that text back into
messages, and their canonical bytes hash as a request carrying those messages would.
vLLM's own hashes serve only as ids, for parent links and removals.

A chain whose text is not a chat the template rendered is a completions prompt: its text,
after the special tokens the tokeniser puts first (a BOS), is the router's bytes as they are.

What does not translate is only not learnt (no harm to routing): tokenisers that are
neither byte-level nor SentencePiece-style BPE as transformers loads a Llama-class one
(rejected at start-up), templates whose messages cannot be told apart
(rejected), content the template changes (trimmed whitespace, joined parts), tools,
multimodal prompts and prompt embeddings (their blocks carry extra keys that change what the
tokens mean; a cache salt or a LoRA name is read from them), completions sent as token ids
or already in the template's markup.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from .config import Config, ConfigError
from .hashing import EMPTY, block_hashes, block_hashes_after, root_hash
from .prompt import canonical_conversation_start, frame_head

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
TIP_BYTES = 32 * 1024 * 1024  # per endpoint: the text of the chains being extended
# KV-cache groups whose blocks do not hold a whole prefix: they free its head early (vLLM's
# KVCacheSpecKind values; any other kind, full attention, MLA, with sinks, is read).
PARTIAL_KINDS = frozenset(
    {"sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba"}
)
MAX_TABLE_BLOCKS = 1_000_000  # per endpoint (~0.3 KiB each): 16M tokens in 16-token blocks
_SENTINEL = "Zq7Xv{}Qw9Jk"  # probe content: survives templates, never in a real prompt


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte <-> printable character map, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """Each token id's bytes, from a Hugging Face ``tokenizer.json``: byte-level BPE (GPT-2's
    alphabet: Llama 3, Qwen, ...) or SentencePiece-style BPE ("▁" for a space, ``<0xNN>``
    byte pieces: Llama 2, Mistral, Phi-3), whose tokens decode to the text plus a space
    the tokeniser put before some pieces (``prepend``; ``as_tokenized``).

    ``single_prefix``: what the tokeniser's post-processor puts before a text it encodes
    alone (Llama 3's ``<|begin_of_text|>``; b"": nothing), which a completions prompt then
    starts with in vLLM's tokens; None: a post-processor this cannot read (completions are
    then not learnt).

    ``prepend``: where a SentencePiece-style tokeniser puts a "▁" the text did not have, in
    each piece of the text between added tokens: "never"; "first" (the piece at the
    text's start, unless it starts with a space: Metaspace's ``prepend_scheme``);
    "always" (every piece, unless it starts with one); "every" (every piece, even then: a
    ``Prepend`` normaliser). ``added``: the added tokens' texts, which split the pieces."""

    def __init__(
        self,
        table: list[bytes],
        single_prefix: bytes | None = b"",
        prepend: str = "never",
        added: Sequence[AddedToken] = (),
        sentencepiece: bool = False,  # "▁" for spaces (else byte-level)
    ) -> None:
        self._table = table
        self.sentencepiece = sentencepiece
        self.single_prefix = single_prefix
        if prepend not in PREPEND_SCHEMES:
            raise ValueError(f"prepend {prepend!r}: one of {PREPEND_SCHEMES}")
        self.prepend = prepend
        tokens = sorted({a for a in added if a.content}, key=lambda a: -len(a.content))
        # Each added token as the tokeniser matches it: with the whitespace it absorbs
        # beside it (lstrip / rstrip: Phi-3's markers), which its id then does not spell.
        patterns = [
            ("\\s*" if a.lstrip else "")
            + f"({re.escape(a.content)})"
            + ("\\s*" if a.rstrip else "")
            for a in tokens
        ]
        self._added = re.compile("|".join(patterns)) if patterns else None
        self._strips = any(a.lstrip or a.rstrip for a in tokens)

    @classmethod
    def from_file(cls, path: str | Path, config: dict[str, Any] | None = None) -> TokenBytes:
        """``config``: tokenizer_config.json beside it, which says how transformers
        rebuilds a SentencePiece-style tokeniser at load (``sentencepiece_prepend``)."""
        spec = orjson.loads(Path(path).read_bytes())
        decoder = spec.get("decoder") or {}
        if decoder.get("type") == "ByteLevel":
            # NFC (Qwen's): only text not already in NFC is missed.
            _refuse_normalizer(path, spec.get("normalizer"), allowed=("NFC",))
            table = _byte_level_table(spec)
            added = _added_tokens(spec)
            return cls(table, _single_prefix(spec.get("post_processor"), table), added=added)
        if not _is_sentencepiece_decoder(decoder):
            raise ValueError(
                f"cache_events.tokenizer {path}: decoder {decoder.get('type')!r}; only "
                "byte-level BPE and SentencePiece-style BPE tokenisers (a Metaspace or "
                "'▁'-replacing decoder) decode byte for byte (the text vLLM hashed)"
            )
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(
                f"cache_events.tokenizer {path}: a SentencePiece-style {model.get('type')!r} "
                "model; only BPE (Llama 2, Mistral, Phi-3) is read"
            )
        prepend = sentencepiece_prepend(path, spec, config or {})
        table = _sentencepiece_table(spec, bool(model.get("byte_fallback")))
        added = _added_tokens(spec)
        prefix = _single_prefix(spec.get("post_processor"), table)
        return cls(table, prefix, prepend, added, sentencepiece=True)

    def as_tokenized(self, text: str) -> str:
        """``text`` as its tokens decode here: with the spaces the tokeniser put before
        pieces of it (``prepend``), without the whitespace an added token absorbed beside
        it. A chat template's renderings go through this, so that its layout is learnt as
        vLLM's tokens spell it."""
        if self.prepend == "never" and not self._strips:
            return text
        out, at = [], 0
        matches = list(self._added.finditer(text)) if self._added is not None else []
        for start, end, content in [
            *((m.start(), m.end(), m.group(m.lastindex or 0)) for m in matches),
            (len(text), len(text), ""),
        ]:
            piece = text[at:start]
            if piece and self._prepends(piece, at):
                piece = " " + piece
            out += (piece, content)
            at = end
        return "".join(out)

    def _prepends(self, piece: str, at: int) -> bool:
        """Whether the tokeniser put a "▁" before this piece of a text (at offset ``at``)."""
        if self.prepend == "every":
            return True
        if self.prepend == "never" or piece.startswith(" "):
            return False
        return self.prepend == "always" or at == 0

    @property
    def lead(self) -> bytes:
        """What a completions prompt's tokens start with after ``single_prefix`` and the
        prompt did not (a text encoded alone starts a piece at its start): a space, or
        none. A prompt that starts with a space itself reads as one without (its tokens
        are the same): not learnt."""
        return b"" if self.prepend == "never" else b" "

    def __len__(self) -> int:
        return len(self._table)

    def decode(self, token_ids: list[int]) -> bytes:
        return b"".join(self._pieces(token_ids))

    def decode_blocks(self, token_ids: list[int], block_size: int, count: int) -> list[bytes]:
        """The bytes of each of ``count`` blocks of ``block_size`` tokens: one lookup pass
        for the whole event (per-block lookups were half a long prompt's cost)."""
        pieces, join = self._pieces(token_ids[: count * block_size]), b"".join
        return [join(pieces[k : k + block_size]) for k in range(0, count * block_size, block_size)]

    def _pieces(self, token_ids: list[int]) -> list[bytes]:
        table = self._table
        if token_ids and min(token_ids) >= 0:  # a negative id would index from the end
            try:
                return list(map(table.__getitem__, token_ids))
            except IndexError:
                pass
        return [table[t] if 0 <= t < len(table) else b"" for t in token_ids]


PREPEND_SCHEMES = ("never", "first", "always", "every")
# tokenizer_config.json classes whose tokeniser transformers (5.x, vLLM 0.32's) loads from
# tokenizer.json as written; a class with its own constructor rebuilds the pipeline.
_AS_WRITTEN = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")
_GEMMA_CLASSES = ("GemmaTokenizer", "GemmaTokenizerFast")  # rebuilt: no "▁" put anywhere
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _steps(part: Any) -> list[dict[str, Any]]:
    """A normaliser / decoder and its steps, a Sequence flattened."""
    if not isinstance(part, dict):
        return []
    if part.get("type") == "Sequence":
        inner = part.get("normalizers") or part.get("decoders") or []
        return [step for step in inner if isinstance(step, dict)]
    return [part]


def _refuse_normalizer(path: str | Path, normalizer: Any, allowed: tuple[str, ...]) -> None:
    kinds = [step.get("type") for step in _steps(normalizer)]
    if any(kind not in allowed for kind in kinds):
        raise ValueError(f"cache_events.tokenizer {path}: normalizer {kinds!r} changes the text")


def _is_sentencepiece_decoder(decoder: dict[str, Any]) -> bool:
    """Metaspace, or Llama's Replace("▁", " ") + ByteFallback + Fuse + Strip(" ")."""
    if decoder.get("type") == "Metaspace":
        return decoder.get("replacement", "▁") == "▁"
    steps = _steps(decoder)
    replaces = [
        s
        for s in steps
        if s.get("type") == "Replace"
        and (s.get("pattern") or {}).get("String") == "▁"
        and s.get("content") == " "
    ]
    others = {s.get("type") for s in steps if s not in replaces}
    strips_space = all(s.get("content") == " " for s in steps if s.get("type") == "Strip")
    return bool(replaces) and others <= {"ByteFallback", "Fuse", "Strip"} and strips_space


def sentencepiece_prepend(path: str | Path, spec: dict[str, Any], config: dict[str, Any]) -> str:
    """Where the tokeniser vLLM loads puts a "▁" the text did not have (TokenBytes'
    ``prepend``). transformers 5 (vLLM 0.32's) rebuilds a Llama-class tokeniser at load,
    whatever tokenizer.json says: no normaliser, and Metaspace prepending "first" unless
    tokenizer_config.json says ``legacy: true`` ("always") or ``add_prefix_space: false``
    ("never"); a Gemma-class one with spaces as "▁" and nothing put before pieces
    ("never"). A generic class loads tokenizer.json as written. Any other class: refused
    (its rebuild is not followed here)."""
    kind = config.get("tokenizer_class")
    if kind in _LLAMA_CLASSES:
        if config.get("add_prefix_space") is False:
            return "never"
        return "always" if config.get("legacy") else "first"
    if kind in _GEMMA_CLASSES:
        return "never"
    if kind not in _AS_WRITTEN:
        raise ValueError(
            f"cache_events.tokenizer {path}: a SentencePiece-style tokeniser of class "
            f"{kind!r}, which transformers rebuilds at load in a way this does not follow "
            f"(read: {', '.join(_LLAMA_CLASSES + _GEMMA_CLASSES)} and the generic class)"
        )
    _refuse_normalizer(path, spec.get("normalizer"), allowed=("Prepend", "Replace"))
    prepends = [s for s in _steps(spec.get("normalizer")) if s.get("type") == "Prepend"]
    if any(s.get("prepend") != "▁" for s in prepends):
        raise ValueError(f"cache_events.tokenizer {path}: a Prepend normaliser of other than '▁'")
    pre = spec.get("pre_tokenizer")
    if prepends:
        if pre:
            raise ValueError(
                f"cache_events.tokenizer {path}: a Prepend normaliser and a pre-tokeniser"
            )
        return "every"
    if not pre:
        return "never"
    if pre.get("type") != "Metaspace" or pre.get("replacement", "▁") != "▁":
        raise ValueError(
            f"cache_events.tokenizer {path}: pre-tokeniser {pre.get('type')!r}; with a "
            "SentencePiece-style decoder only Metaspace is read"
        )
    scheme = pre.get("prepend_scheme") or ("always" if pre.get("add_prefix_space") else "never")
    if scheme not in ("never", "first", "always"):
        raise ValueError(f"cache_events.tokenizer {path}: Metaspace prepend_scheme {scheme!r}")
    return scheme


class AddedToken(NamedTuple):
    """An added token's text, and whether it absorbs the whitespace before / after it."""

    content: str
    lstrip: bool = False
    rstrip: bool = False


def _added_tokens(spec: dict[str, Any]) -> list[AddedToken]:
    return [
        AddedToken(t.get("content", ""), bool(t.get("lstrip")), bool(t.get("rstrip")))
        for t in spec.get("added_tokens", [])
        if isinstance(t, dict)
    ]


def _byte_level_table(spec: dict[str, Any]) -> list[bytes]:
    to_byte = {c: b for b, c in byte_level_alphabet().items()}
    table: dict[int, bytes] = {}
    for token, token_id in spec["model"]["vocab"].items():
        try:
            table[token_id] = bytes(to_byte[c] for c in token)
        except KeyError:
            table[token_id] = token.encode()
    return _with_added(table, spec)


def _sentencepiece_table(spec: dict[str, Any], byte_fallback: bool) -> list[bytes]:
    """Each piece with "▁" as a space; with byte fallback a ``<0xNN>`` piece is that byte
    (the UTF-8 of a character outside the vocabulary, a byte per piece)."""
    table: dict[int, bytes] = {}
    for token, token_id in spec["model"]["vocab"].items():
        byte = _BYTE_PIECE.fullmatch(token) if byte_fallback else None
        table[token_id] = bytes([int(byte[1], 16)]) if byte else token.replace("▁", " ").encode()
    return _with_added(table, spec)


def _with_added(table: dict[int, bytes], spec: dict[str, Any]) -> list[bytes]:
    for added in spec.get("added_tokens", []):
        table[added["id"]] = added["content"].encode()
    size = max(table) + 1
    return [table.get(i, b"") for i in range(size)]


def _single_prefix(processor: Any, table: list[bytes]) -> bytes | None:
    """The bytes of the special tokens a ``tokenizer.json`` post-processor puts before a
    single sequence (TemplateProcessing's ``single``, in a Sequence or alone; ByteLevel adds
    none); None for any other post-processor. Tokens it puts after the sequence (an EOS)
    only end a completion's last block, whose hashes then meet nothing."""
    if not processor:
        return b""
    kind = processor.get("type") if isinstance(processor, dict) else None
    if kind == "ByteLevel":
        return b""
    if kind == "Sequence":
        parts = [_single_prefix(p, table) for p in processor.get("processors") or []]
        return None if any(p is None for p in parts) else b"".join(parts)  # type: ignore[arg-type]
    if kind != "TemplateProcessing":
        return None
    prefix = b""
    for piece in processor.get("single") or []:
        if "Sequence" in piece:
            return prefix
        name = (piece.get("SpecialToken") or {}).get("id")
        ids = ((processor.get("special_tokens") or {}).get(name) or {}).get("ids")
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and 0 <= i < len(table) for i in ids
        ):
            return None
        prefix += b"".join(table[i] for i in ids)
    return None  # no sequence: not a template for text


def template_environment(now: datetime.datetime | None = None, dated: list | None = None) -> Any:
    """Jinja as transformers and vLLM render chat templates (sandboxed, trimmed blocks).
    ``strftime_now`` gives ``now`` (default: the clock), and appends to ``dated`` if given."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def strftime_now(fmt: str) -> str:
        if dated is not None:
            dated.append(fmt)
        return (now or datetime.datetime.now()).strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


@dataclass
class ChatLayout:
    """Where a chat template puts each message: what comes before a conversation's first
    message of each role (``starts``), between a message of one role and the next of
    another (``separators``, the generation prompt included), and after a last message
    (``ends``). Learnt from the template's own renderings of probe conversations."""

    starts: dict[str, bytes]
    separators: dict[str, list[tuple[bytes, str]]]
    ends: dict[str, bytes]
    dated: bool = False  # the template printed the date (strftime_now): it holds that day

    @classmethod
    def from_template(
        cls,
        template: str,
        bos_token: str = "",
        eos_token: str = "",
        now: datetime.datetime | None = None,
        tokenized: Callable[[str], str] | None = None,
    ) -> ChatLayout:
        """The layout the template renders at ``now`` (default: the clock), as the
        tokens spell it (``tokenized``: TokenBytes.as_tokenized; default: as rendered)."""
        from jinja2 import TemplateError

        dated: list[str] = []
        try:
            compiled = template_environment(now, dated).from_string(template)
        except TemplateError as exc:
            raise ValueError(f"cache_events.chat_template does not compile: {exc}") from None

        def render(messages: list[tuple[str, str]], generate: bool = False) -> str | None:
            try:
                text = compiled.render(
                    messages=[{"role": r, "content": c} for r, c in messages],
                    add_generation_prompt=generate,
                    bos_token=bos_token,
                    eos_token=eos_token,
                    tools=None,
                )
            except Exception:  # a template may refuse an order of roles: that pair is unknown
                return None
            return tokenized(text) if tokenized is not None else text

        first, second = _SENTINEL.format(0), _SENTINEL.format(1)
        starts: dict[str, bytes] = {}
        ends: dict[str, bytes] = {}
        separators: dict[str, list[tuple[bytes, str]]] = {r: [] for r in ROLES}
        for role in ROLES:
            text = render([(role, first)])
            if text is None or text.count(first) != 1:
                continue
            before, after = text.split(first)
            starts[role], ends[role] = before.encode(), after.encode()
            prompted = render([(role, first)], generate=True)
            if prompted is not None and prompted.startswith(text) and len(prompted) > len(text):
                separators[role].append((prompted.split(first)[1].encode(), "assistant"))
        for role in ROLES:
            for following in ROLES:
                # A pair alone, else after a user message: Llama 2's and Mistral's templates
                # refuse a conversation that an assistant message starts.
                text = render([(role, first), (following, second)])
                if text is None and role == "assistant":
                    text = render([("user", "Hello."), (role, first), (following, second)])
                if text is None or text.count(first) != 1 or text.count(second) != 1:
                    continue
                between = text.split(first)[1].split(second)[0].encode()
                if between and (between, following) not in separators[role]:  # '': no mark
                    separators[role].append((between, following))
        for role in separators:  # the longest first: one separator may begin another
            separators[role].sort(key=lambda item: -len(item[0]))
        layout = cls(starts, separators, ends, bool(dated))
        layout._check(render)
        return layout

    def _check(self, render: Any) -> None:
        probe = [
            ("system", "You are terse."),
            ("user", "What is a KV cache?"),
            ("assistant", "Reused attention state."),
            ("user", "And a prefix?"),
        ]
        if "system" not in self.starts:
            probe = probe[1:]
        reply = "A reply"
        prompted = render(probe, generate=True)
        replied = None if prompted is None else prompted + reply
        if prompted is not None and prompted == render(probe):
            # No generation prompt (Llama 2's, Mistral's templates): the reply follows the
            # prompt as the model writes it, which for these is as the template writes it
            # after the last message ("[/INST]" then the reply): read it from there.
            full = render([*probe, ("assistant", reply)])
            replied = None if full is None else full[: full.rfind(reply) + len(reply)]
        expected = [(r, c.encode()) for r, c in probe] + [("assistant", reply.encode())]
        text = None if replied is None else replied.encode()
        spans = None if text is None else self.split(text)
        got = None if spans is None or text is None else [(r, text[a:b]) for r, a, b in spans]
        if got != expected:
            raise ValueError(
                "cache_events.chat_template: its messages cannot be told apart in its output "
                f"(a probe conversation split as {got!r})"
            )

    def split(self, text: bytes, at: int = 0, role: str = "") -> list[tuple[str, int, int]] | None:
        """The messages of a rendered conversation, or of its start (a cached chain stops
        anywhere): (role, content start, content end) offsets in ``text``; None when the
        text is not a chat this template rendered. Trailing bytes that may begin the
        template's markup after a message are left out of it. With ``role``, the text is
        read from ``at``, where a message of that role begins its content."""
        if not role:
            found_start = next((r for r, s in self.starts.items() if text.startswith(s)), None)
            if found_start is None:  # too short to tell yet: a chat with no content so far
                return [] if any(s.startswith(text) for s in self.starts.values()) else None
            role, at = found_start, len(self.starts[found_start])
        messages: list[tuple[str, int, int]] = []
        # Each separator's next occurrence, searched again only once passed: a separator
        # a conversation never uses would otherwise be sought to its end at every message.
        upcoming: dict[bytes, int] = {}
        while True:
            found, found_length, found_role = -1, 0, ""
            for separator, following in self.separators[role]:
                where = upcoming.get(separator, -2)
                if -1 != where < at:
                    where = upcoming[separator] = text.find(separator, at)
                if where >= 0 and (found < 0 or where < found):
                    found, found_length, found_role = where, len(separator), following
            if found < 0:
                break
            messages.append((role, at, found))
            at, role = found + found_length, found_role
        tail = text[at:]
        markup = [s for s, _ in self.separators[role]] + [self.ends.get(role, b"")]
        cut = max(
            (
                k
                for m in markup
                for k in range(1, min(len(m), len(tail)) + 1)
                if m.startswith(tail[len(tail) - k :])
            ),
            default=0,
        )
        messages.append((role, at, len(text) - cut))
        return messages

    def canonical(self, text: bytes, after: Parsed | None = None) -> Parsed | None:
        """The canonical bytes of a rendered chat's start, and where each message's content
        lies in both (``Parsed.segments``). ``after``: the parse of a start of ``text``;
        only its last (open) message and what follows are read again, so a chain growing a
        block at a time costs the block, not the conversation."""
        base = b""
        if after is not None and after.open_role:
            spans = self.split(text, after.open_at, after.open_role)
            base = after.canonical[: after.closed]
        else:
            spans = self.split(text)
        if spans is None:
            return None
        messages = [(role, text[start:end]) for role, start, end in spans]
        tail, content_starts = canonical_conversation_start(messages)
        segments = [
            (start, len(base) + content_start, end - start)
            for (_, start, end), content_start in zip(spans, content_starts, strict=True)
        ]
        if not spans:
            return Parsed(base + tail, segments, 0, "", 0)
        role, start, _ = spans[-1]
        closed = segments[-1][1] - len(frame_head(role))
        return Parsed(base + tail, segments, start, role, closed)


def chain_salt(extra_keys: Any, lora_name: str | None, first: bool) -> str | None:
    """The ``cache_salt`` a chain's blocks were hashed with ("" none), from the untagged
    extra keys vLLM publishes per block: the LoRA name (when the event names one), (media
    id, offset) pairs, the salt (on a chain's first block) and prompt-embedding digests.
    None: keys that change what the tokens mean (media, prompt embeddings), which a
    request's bytes cannot match. ``first``: the chain starts a prompt (no parent)."""
    if extra_keys is None:
        return ""
    if not isinstance(extra_keys, list | tuple):
        return None
    salt = ""
    for k, keys in enumerate(extra_keys):
        if keys is None:
            continue
        if not isinstance(keys, list | tuple):
            return None
        if lora_name and keys and keys[0] == lora_name:
            keys = keys[1:]
        if not keys:
            continue
        if first and k == 0 and len(keys) == 1 and isinstance(keys[0], str):
            salt = keys[0]
            continue
        return None
    return salt


class DatedLayouts:
    """A chat template's layouts by day. A template that prints today's date (Llama 3.2's
    system header, through ``strftime_now``) renders a different start each day, and a
    layout learnt once at start-up would stop reading every chat at the first midnight.
    So the day's layout is learnt when the day comes, and a chain that the day's does not
    read is tried with the day before's and after's (a chain rendered before midnight and
    announced after it; a model server whose clock or time zone differs by hours)."""

    KEPT_DAYS = 4

    def __init__(
        self,
        template: str,
        bos_token: str = "",
        eos_token: str = "",
        clock: Callable[[], datetime.datetime] = datetime.datetime.now,
        tokenized: Callable[[str], str] | None = None,
    ) -> None:
        self._template, self._bos, self._eos, self._clock = template, bos_token, eos_token, clock
        self._tokenized = tokenized
        self._by_day: OrderedDict[datetime.date, ChatLayout] = OrderedDict()
        today = self._clock().date()
        self._first = self._learn(today)  # a template it cannot read fails here, at start-up
        self._by_day[today] = self._first
        self.dated = self._first.dated

    def _learn(self, day: datetime.date) -> ChatLayout:
        noon = datetime.datetime.combine(day, datetime.time(12))
        return ChatLayout.from_template(self._template, self._bos, self._eos, noon, self._tokenized)

    def for_day(self, day: datetime.date) -> ChatLayout:
        layout = self._by_day.get(day)
        if layout is None:
            try:
                layout = self._learn(day)
            except Exception:  # a day it cannot read the template on: start-up's layout
                log.warning("cache_events: the chat template's layout for %s: unreadable", day)
                layout = self._first
            self._by_day[day] = layout
            while len(self._by_day) > self.KEPT_DAYS:
                self._by_day.popitem(last=False)
        return layout

    def today(self) -> ChatLayout:
        return self.for_day(self._clock().date())

    def canonical(self, text: bytes, after: Parsed | None = None) -> Parsed | None:
        """ChatLayout.canonical with the day's layout, then (a dated template) its
        neighbours'."""
        if not self.dated:  # the same every day
            return self._first.canonical(text, after)
        today = self._clock().date()
        for shift in (0, -1, 1):
            day = today + datetime.timedelta(days=shift)
            parsed = self.for_day(day).canonical(text, after)
            if parsed is not None:
                return parsed
        return None


COMPLETION = "completion"  # Parsed.open_role of a completions prompt's text


def completion_parse(text: bytes, prefix: bytes | None, lead: bytes = b"") -> Parsed | None:
    """A completions prompt (its text after the tokeniser's ``prefix``, e.g. a BOS, and the
    ``lead`` its tokens put before the prompt, TokenBytes.lead) in the router's bytes,
    which are the prompt's text itself (prompt.py); None: not one."""
    if prefix is None or not text.startswith(prefix):
        return None
    start = len(prefix)
    if lead and text.startswith(lead, start):
        start += len(lead)
    return Parsed(text[start:], [(start, 0, len(text) - start)], start, COMPLETION, 0)


class Parsed(NamedTuple):
    """A rendered chat's start in canonical bytes (ChatLayout.canonical), or a completions
    prompt's (completion_parse)."""

    canonical: bytes
    # Each message's content read by this parse: (text start, canonical start, length), to
    # place a text offset in the canonical bytes (content maps byte for byte, markup to
    # the content before it).
    segments: list[tuple[int, int, int]]
    open_at: int  # where the last message's content starts in the text, which may grow
    open_role: str  # its role ("": no message yet)
    closed: int  # canonical bytes before its frame: the messages that cannot change


def canonical_offsets(segments: list[tuple[int, int, int]], text_offsets: list[int]) -> list[int]:
    """How many canonical bytes the text before each of ``text_offsets`` (ascending) gives
    (ChatLayout.canonical): one sweep, as a long conversation has a segment per message."""
    out, offset, k = [], 0, 0
    for text_offset in text_offsets:
        while k < len(segments) and segments[k][0] < text_offset:
            k += 1
        if k:  # the last segment starting before text_offset
            text_start, canonical_start, length = segments[k - 1]
            offset = canonical_start + min(text_offset - text_start, length)
        out.append(offset)
    return out


class _Tip(NamedTuple):
    """A chain that may grow next: its text, the router hash of its last whole block, and
    its parse (which the next block's parse resumes)."""

    text: bytes
    last_hash: int
    parsed: Parsed

    @property
    def size(self) -> int:
        return len(self.text) + len(self.parsed.canonical)


# One announced block (~0.3 KiB with its text: bench events' memory line), a plain tuple:
# the garbage collector stops tracking a tuple of ints and bytes, not a NamedTuple, and a
# table of a million tracked blocks made every full collection take ~170 ms (~13 ms
# untracked), a pause decisions wait out. Fields, by index:
_PARENT = 0  # int | None: the parent block's vLLM hash
_TEXT = 1  # bytes: its tokens' text
_ROUTER_END = 2  # router blocks held once it is: the chain's first _ROUTER_END hashes
_HASHES = 3  # bytes: the router hashes it added (uint64; an array costs ~100 B more)
_Block = tuple[int | None, bytes, int, bytes]


@dataclass(frozen=True)
class Translation:
    """What translating needs, loaded once and shared by every endpoint's table."""

    tokens: TokenBytes
    layout: ChatLayout | DatedLayouts  # DatedLayouts for a model's own template
    model: str  # the name clients send: it roots the router's hashes
    block_size: int  # the router's block size in bytes (routing.block_size_bytes)
    max_blocks: int  # its hash window (routing.max_blocks)

    def describe(self) -> str:
        """One line on what was read, for start-up's log and ``config --check``: an
        operator checks the tokeniser and template were read as the server reads them."""
        tokens = self.tokens
        kind = "SentencePiece-style BPE" if tokens.sentencepiece else "byte-level BPE"
        where = {
            "never": "nowhere",
            "first": "the text's start",
            "always": "each piece after an added token",
            "every": "each piece, always",
        }[tokens.prepend]
        layout = self.layout
        chat = layout.today() if isinstance(layout, DatedLayouts) else layout
        dated = isinstance(layout, DatedLayouts) and layout.dated
        prefix = "not learnt" if tokens.single_prefix is None else repr(tokens.single_prefix)
        return (
            f"{kind}, {len(tokens)} tokens"
            + (f', a "▁" put before {where}' if tokens.sentencepiece else "")
            + f"; chat template: first messages {'/'.join(chat.starts) or 'none'}"
            + (", printing the date" if dated else "")
            + f"; completions after {prefix}"
        )


class EndpointCacheEvents:
    """One endpoint's announced blocks, and their translation into this router's hashes."""

    def __init__(
        self,
        translation: Translation,
        tip_bytes: int = TIP_BYTES,
        max_table_blocks: int = MAX_TABLE_BLOCKS,
    ) -> None:
        self.tokens, self.layout = translation.tokens, translation.layout
        self.model = translation.model
        self.block_size, self.max_blocks = translation.block_size, translation.max_blocks
        self._blocks: dict[int, _Block] = {}
        # The whole text of chains that may grow next (a reply being generated adds a block
        # at a time), with the router hash of their last whole block and their parse: a new
        # block then costs itself, not a walk up its chain, a parse of its conversation and
        # a hash of all of it (bench events, --turns).
        self._tips: OrderedDict[int, _Tip] = OrderedDict()
        self._tip_bytes, self._tips_held = tip_bytes, 0
        self.max_table_blocks = max_table_blocks
        # The cache salt of a salted chain, by its first block's vLLM hash: a chain's later
        # blocks (a reply, a next turn) carry none, and their hashes start from its root.
        self._salts: dict[Any, str] = {}
        self.untranslated = 0  # stored blocks that gave no hashes of this router's
        # Hybrid models (sliding-window or Mamba layers beside full attention) announce each
        # KV-cache group's blocks under the same hashes with its ``group_idx``; only the first
        # group of another kind (PARTIAL_KINDS) is read: a sliding-window group frees a
        # prompt's head early, and its removals would empty blocks full attention still holds.
        self._group: int | None = None
        self._partial_groups: set[int] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def _reads(self, event: dict[str, Any]) -> bool:
        """Whether an event's KV-cache group is the one read (events without a group, from
        vLLMs that do not send one, are all read)."""
        group, kind = event.get("group_idx"), event.get("kv_cache_spec_kind")
        if group is None:
            return True
        if kind in PARTIAL_KINDS:
            self._partial_groups.add(group)
            return False
        if self._group is None and kind is not None:
            self._group = group
        return group not in self._partial_groups and self._group in (None, group)

    def stored(
        self,
        block_hashes_: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        lora_name: str | None = None,
        extra_keys: list[Any] | None = None,
    ) -> np.ndarray:
        """A chain the endpoint computed: the router hashes it newly holds, in order."""
        if not block_hashes_:
            return EMPTY
        above = self._blocks.get(parent) if parent is not None else None
        if parent is not None and above is None:  # a parent this subscriber never saw
            return self._untranslated(block_hashes_)
        salt = chain_salt(extra_keys, lora_name, first=parent is None)
        if salt is None:  # images or other media, prompt embeddings
            return self._untranslated(block_hashes_)
        texts = self.tokens.decode_blocks(token_ids, block_size, len(block_hashes_))
        start_end = above[_ROUTER_END] if above is not None else 0
        if start_end >= self.max_blocks:  # past the hash window: nothing new to learn
            return self._remember(
                block_hashes_, parent, texts, [start_end] * len(texts), EMPTY, start_end
            )
        tip = self._take_tip(parent)
        if tip is not None:
            prefix, previous, after = tip
        else:
            chain = self._chain(parent)
            if chain is None:
                return self._untranslated(block_hashes_)
            prefix, first = chain
            if first is not None:  # a salt is on its chain's first block only
                salt = self._salts.get(first, "")
            previous, after = root_hash(lora_name or self.model, salt), None
        text = prefix + b"".join(texts)
        parsed = self._parse(text, after)
        if parsed is None:
            return self._untranslated(block_hashes_)
        canonical, segments = parsed.canonical, parsed.segments
        if tip is not None:
            hashes = block_hashes_after(
                canonical, previous, start_end, self.block_size, self.max_blocks
            )
        else:
            hashes = block_hashes(canonical, previous, self.block_size, self.max_blocks)[start_end:]
        text_ends = list(itertools.accumulate(map(len, texts), initial=len(prefix)))[1:]
        most = start_end + len(hashes)
        ends = [
            max(start_end, min(held // self.block_size, most))
            for held in canonical_offsets(segments, text_ends)
        ]
        last = ends[-1] - start_end
        last_hash = int(hashes[last - 1]) if last else previous
        self._keep_tip(block_hashes_[-1], _Tip(text, last_hash, parsed))
        if salt and parent is None:
            self._salts[block_hashes_[0]] = salt
        return self._remember(block_hashes_, parent, texts, ends, hashes, start_end)

    def _parse(self, text: bytes, after: Parsed | None) -> Parsed | None:
        """A chain's text as a chat this template rendered, else as a completions prompt.
        A chat's text starts with the template's markup for its first message, which a
        completion's rarely does (one that does, a client applying the template itself, is
        read as the chat and meets nothing of the router's: not learnt)."""
        if after is None or after.open_role != COMPLETION:
            parsed = self.layout.canonical(text, after)
            if parsed is not None:
                return parsed
        return completion_parse(text, self.tokens.single_prefix, self.tokens.lead)

    def _chain(self, block: int | None) -> tuple[bytes, int | None] | None:
        """The text of a chain up to ``block``, walked up its parents, and its first block
        (None: ``block`` is None); None: a block unknown on the way."""
        pieces: list[bytes] = []
        first = block
        while block is not None:
            known = self._blocks.get(block)
            if known is None:
                return None
            pieces.append(known[_TEXT])
            first, block = block, known[_PARENT]
        return b"".join(reversed(pieces)), first

    def _take_tip(self, block: int | None) -> _Tip | None:
        tip = self._tips.pop(block, None) if block is not None else None
        if tip is not None:
            self._tips_held -= tip.size
        return tip

    def _keep_tip(self, block: int, tip: _Tip) -> None:
        self._tips[block] = tip
        self._tips_held += tip.size
        while self._tips_held > self._tip_bytes and self._tips:
            self._tips_held -= self._tips.popitem(last=False)[1].size

    def _remember(
        self,
        block_hashes_: list[int],
        parent: int | None,
        texts: list[bytes],
        ends: list[int],
        hashes: np.ndarray,
        start_end: int,
    ) -> np.ndarray:
        """Enter the blocks; ``hashes[k]`` is router block ``start_end + k``."""
        previous, packed = start_end, hashes.tobytes()
        for vllm_hash, piece, end in zip(block_hashes_, texts, ends, strict=True):
            added = packed[(previous - start_end) * 8 : (end - start_end) * 8]
            self._blocks.pop(vllm_hash, None)  # stored again: now the newest
            self._blocks[vllm_hash] = (parent, piece, end, added)
            parent, previous = vllm_hash, max(previous, end)
        # Evictions missed (a gap no replay filled) would leave blocks here for good: past
        # the cap, the longest-stored go (their extensions then no longer translate).
        while len(self._blocks) > self.max_table_blocks:
            oldest = next(iter(self._blocks))
            del self._blocks[oldest]
            self._salts.pop(oldest, None)
        return hashes[: previous - start_end].copy()

    def _untranslated(self, block_hashes_: list[int]) -> np.ndarray:
        self.untranslated += len(block_hashes_)
        return EMPTY

    def removed(self, block_hashes_: list[int]) -> np.ndarray:
        """Blocks the endpoint evicted: the router hashes they had added."""
        for block in block_hashes_:
            self._take_tip(block)
            self._salts.pop(block, None)
        added = b"".join(
            b[_HASHES] for h in block_hashes_ if (b := self._blocks.pop(h, None)) is not None
        )
        return np.frombuffer(added, dtype=np.uint64).copy() if added else EMPTY

    def cleared(self) -> None:
        self._blocks.clear()
        self._salts.clear()
        self._tips.clear()
        self._tips_held = 0

    def apply(self, events: list[Any]) -> list[tuple[bool | None, np.ndarray]]:
        """One message's events, in order, as ``Router.observe_cache_events`` takes them:
        (True, router hashes stored), (False, router hashes removed), and (None, EMPTY)
        where the endpoint cleared its whole cache (the router then forgets it; vLLM sends
        that in the same message as what it stored next). Events of other kinds or
        shapes, and blocks kept in another medium (CPU offload), are skipped."""
        out: list[tuple[bool | None, np.ndarray]] = []
        for event in events:
            if not isinstance(event, dict) or event.get("medium") not in (None, "GPU"):
                continue
            if not self._reads(event):
                continue
            kind = event.get("type")
            if kind == "BlockStored":
                hashes = self.stored(
                    event.get("block_hashes") or [],
                    event.get("parent_block_hash"),
                    event.get("token_ids") or [],
                    int(event.get("block_size") or 0) or 1,
                    event.get("lora_name"),
                    event.get("extra_keys"),
                )
                if len(hashes):
                    out.append((True, hashes))
            elif kind == "BlockRemoved":
                hashes = self.removed(event.get("block_hashes") or [])
                if len(hashes):
                    out.append((False, hashes))
            elif kind == "AllBlocksCleared":
                self.cleared()
                out.append((None, EMPTY))
        return out


def in_pieces(events: list[Any], piece_tokens: int) -> list[list[Any]]:
    """A message's events in order, a stored chain longer than ``piece_tokens`` split into
    consecutive chains of at most that many tokens (each the parent of the next, as vLLM
    announces a prompt prefilled in chunks), so that decisions can run between pieces: one
    long prompt's event held the event loop ~13 ms at 512 KiB (bench events). The
    translation is the same (tests)."""
    parts: list[list[Any]] = []
    together: list[Any] = []  # events applied as one part, as they came
    together_tokens = 0
    for event in events:
        if not _longer_chain(event, piece_tokens):
            together.append(event)
            # Many shorter chains of one message add up too (a step that prefilled many
            # prompts): 64 of ~7,500 tokens held the loop ~133 ms as one part.
            tokens = event.get("token_ids") if isinstance(event, dict) else None
            together_tokens += len(tokens) if isinstance(tokens, list) else 0
            if together_tokens >= piece_tokens:
                parts.append(together)
                together, together_tokens = [], 0
            continue
        if together:
            parts.append(together)
            together, together_tokens = [], 0
        hashes, size = event["block_hashes"], event["block_size"]
        step = max(1, piece_tokens // size)
        tokens, keys = event.get("token_ids") or [], event.get("extra_keys")
        for start in range(0, len(hashes), step):
            piece = dict(event)
            piece["block_hashes"] = hashes[start : start + step]
            piece["token_ids"] = tokens[start * size : (start + step) * size]
            if start:
                piece["parent_block_hash"] = hashes[start - 1]
            if isinstance(keys, list):
                piece["extra_keys"] = keys[start : start + step]
            parts.append([piece])
    if together:
        parts.append(together)
    return parts


def _longer_chain(event: Any, tokens: int) -> bool:
    """A well-formed BlockStored of more than ``tokens`` tokens (what in_pieces slices)."""
    if not isinstance(event, dict) or event.get("type") != "BlockStored":
        return False
    hashes, size = event.get("block_hashes"), event.get("block_size")
    return (
        isinstance(hashes, list)
        and isinstance(size, int)
        and size > 0
        and isinstance(event.get("token_ids") or [], list)
        and len(hashes) * size > tokens
    )


def message_sequence(frames: list[bytes]) -> int | None:
    """A vLLM KV-event message's sequence number: frames [topic, 8-byte big-endian
    sequence, msgpack payload]; None when the frames are not of that shape."""
    return int.from_bytes(frames[1], "big") if len(frames) == 3 and len(frames[1]) == 8 else None


def decode_message(frames: list[bytes]) -> tuple[int, list[Any]]:
    """A vLLM KV-event message (``message_sequence``'s frames, the payload
    ``[timestamp, events, data_parallel_rank]``) -> (sequence, events as maps)."""
    import msgspec

    sequence = message_sequence(frames)
    if sequence is None:
        raise ValueError(f"not a KV-event message: {len(frames)} frames")
    try:
        payload = msgspec.msgpack.decode(frames[2])
    except RecursionError as exc:  # ~1,000 levels of nesting in ~1 KB (DecodeError is one)
        raise ValueError("KV-event payload nested too deeply") from exc
    if not isinstance(payload, list) or len(payload) < 2 or not isinstance(payload[1], list):
        raise ValueError("KV-event payload is not [timestamp, events, ...]")
    return sequence, payload[1]


def load_translation(path: str | Path, model: str, block_size: int, max_blocks: int) -> Translation:
    """A translator for a Hugging Face model directory's ``tokenizer.json`` and the chat
    template in ``tokenizer_config.json`` (or ``chat_template.jinja`` beside it)."""
    directory = Path(path)
    config = orjson.loads((directory / "tokenizer_config.json").read_bytes())
    template = config.get("chat_template")
    if not isinstance(template, str) and (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        raise ValueError(f"cache_events: no chat template in {directory}")

    def token_text(value: Any) -> str:
        return value.get("content", "") if isinstance(value, dict) else str(value or "")

    if mistral_format(directory):
        log.warning(
            "cache_events.model_dir %s: Mistral's own files (consolidated*.safetensors with "
            "tekken.json or tokenizer.model.v*): vLLM (tokenizer_mode auto) then renders and "
            "tokenises with mistral_common, not this chat template and tokeniser, and its "
            "events may not translate (untranslated_blocks); start it with "
            "--tokenizer-mode hf to read them",
            directory,
        )
    tokens = TokenBytes.from_file(directory / "tokenizer.json", config)
    layout = DatedLayouts(
        template,
        token_text(config.get("bos_token")),
        token_text(config.get("eos_token")),
        tokenized=tokens.as_tokenized,
    )
    return Translation(tokens, layout, model, block_size, max_blocks)


def mistral_format(directory: Path) -> bool:
    """Whether vLLM 0.32's tokenizer_mode auto picks "mistral" for this model directory
    (vllm/tokenizers/registry.py): its weights as consolidated*.safetensors and a
    mistral_common tokeniser file beside them."""
    return any(directory.glob("consolidated*.safetensors")) and (
        (directory / "tekken.json").exists() or any(directory.glob("tokenizer.model.v*"))
    )


def translation_from_config(config: Config) -> Translation:
    """The translation ``config.cache_events`` asks for, or a ConfigError naming the field
    (a missing file, a tokeniser or chat template it cannot use): checked at start-up and
    by ``prefix-router config --check``."""
    try:
        translation = load_translation(
            config.cache_events.model_dir,
            config.cache_events.model,
            config.routing.block_size_bytes,
            config.routing.max_blocks,
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"config field cache_events.model_dir: {exc}") from None
    log.info("cache_events.model_dir %s: %s", config.cache_events.model_dir, translation.describe())
    return translation
