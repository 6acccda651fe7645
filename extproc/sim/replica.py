"""One simulated model server: a block-level LRU prefix cache and a continuous-batching clock.

Time model (deliberately small; every constant is in CostModel and printed with results):
- Prefill runs in steps, FIFO: when the last step has ended, the next takes the head of the
  queue and then, as vLLM's scheduler fills a step up to max_num_batched_tokens, the
  requests after it whose uncached tokens fit in what is left of ``prefill_batch_tokens``
  (the decoding requests' one token each counted); 0 is one request a step, the model of
  every figure before Dec 6. A request starts when the batch has room (``max_batch``
  sequences and ``capacity_tokens`` of KV for the running ones; an empty replica always
  admits). Its cached prefix is looked up at that moment, as vLLM does when it schedules
  the request. Not modelled: a prompt longer than the budget split over several steps
  (it runs whole, in a step of its own).
- prefill_ms(n, u) = base + a·u + b·u·(n − u/2) for n prompt tokens of which u are not
  cached: a linear term plus attention over the context. Fitted to an 8B model on one H200
  (/work/shared/notes/prefill-cost.md): 16,384 tokens cold 592 ms / 90% cached 117 (meas.
  121) / 97% cached 61 (55); 4,096 tokens cold 122 (123) / 90% cached 46 (48). A step pays
  the base once (at batch 1 it is mostly launch overhead, ~25 ms in the eager-mode
  measurement) and each of its requests its own a·u + b·u·(n − u/2).
- Decode runs beside prefill (no interference modelled): output_tokens steps of
  base + per_seq·batch + per_ctx·(KV tokens in the batch) ms, with the batch frozen at the
  request's first token. Decode constants are a memory-bandwidth estimate, not measured.
The cache holds prompt KV only (not generated tokens), in whole ``kv_block_tokens`` blocks.

Memory, ``kv_pool="shared"`` (items 24-25): one pool of ``capacity_tokens``,
as vLLM has — running requests pin their prompt chunks (a prefix they share is held once)
plus their output and partial last block; what no running request uses is the prefix cache,
evicted when the pool needs room (cache.KVPool). A request is admitted when what it adds to
the pinned units fits. ``kv_pool="split"`` is the model of every figure before item 24: a
prefix cache of ``capacity_tokens`` and, beside it, running requests' whole prompts and
outputs (shared prefixes once per request) in a second budget of the same size.

``kv_pool="preempt"`` (the default since item 26) is the shared pool with vLLM's
allocation: a request is admitted on its prompt and first output block only, each further
block of ``kv_block_tokens`` output tokens is taken as it is generated, and when the pool
has none free the most recently admitted running request is preempted (vLLM V1's FCFS
``running.pop()``): its blocks are released (its prompt stays as prefix cache, except what
a prefill it was in the middle of had not computed), it goes back to the head of the queue,
and when it is admitted again it recomputes its prompt and the output it had, then goes on.
The engine drives it: ``grow`` at every output block, ``epoch`` to drop the events of a
request that was preempted (or finished) since they were scheduled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .cache import ChunkLRU, KVPool
from .workloads import SimRequest


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_base_ms: float = 36.0
    prefill_ms_per_token: float = 0.01672
    prefill_ms_per_token_ctx: float = 2.105e-6
    decode_base_ms: float = 8.0
    decode_ms_per_seq: float = 0.05
    decode_ms_per_ctx_token: float = 2.7e-5
    kv_block_tokens: int = 16
    max_batch: int = 128
    # Prompt tokens one prefill step computes for several requests together (vLLM's
    # max_num_batched_tokens: 8,192 for its API server on an H100 / H200), the decoding
    # requests' one token each included; 0: one request at a time (every figure before Dec 6).
    prefill_batch_tokens: int = 8192

    def prefill_ms(self, tokens: int, cached: int) -> float:
        new = max(1, tokens - cached)  # a fully cached prompt still computes its last token
        return (
            self.prefill_base_ms
            + self.prefill_ms_per_token * new
            + self.prefill_ms_per_token_ctx * new * (tokens - new / 2)
        )

    def prefill_tokens_ms(self, tokens: int, cached: int) -> float:
        """A prefill's time beside the step's fixed cost, which a batch pays once."""
        new = max(1, tokens - cached)  # a fully cached prompt still computes its last token
        return self.prefill_ms_per_token * new + self.prefill_ms_per_token_ctx * new * (
            tokens - new / 2
        )

    def decode_step_ms(self, batch: int, ctx_tokens: int) -> float:
        return (
            self.decode_base_ms
            + self.decode_ms_per_seq * batch
            + self.decode_ms_per_ctx_token * ctx_tokens
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


KV_POOLS = ("shared", "split", "preempt")
# vLLM's allocation (item 26); "shared" reproduces the figures of items 24-25, "split" older.
DEFAULT_KV_POOL = "preempt"


@dataclass(slots=True)
class Progress:
    """A request under kv_pool="preempt": how far it got and what it holds of the pool."""

    request: SimRequest
    generated: int = 0  # output tokens produced so far (0 until its first prefill ends)
    private: int = 0  # units pinned beside its prompt chunks: partial block + output blocks
    epoch: int = 0  # bumped at every preemption; older events of the request are stale
    prefilling: bool = False
    cached_chunks: int = 0  # leading prompt chunks cached when its prefill started
    step_ms: float = 0.0  # decode step of its current run (0 until its first prefill ends)
    at_ms: float = 0.0  # when it had produced ``generated`` tokens


def cache_units(request: SimRequest, block_tokens: int) -> tuple[int, int]:
    """Cacheable tokens of a full chunk and of the last chunk: whole KV blocks only."""
    full = request.chunk_tokens // block_tokens * block_tokens
    last = request.last_tokens // block_tokens * block_tokens
    return full, last


class Replica:
    """KV cache + queues + counters of one model server."""

    def __init__(
        self,
        index: int,
        capacity_tokens: int,
        cost: CostModel,
        kv_pool: str = DEFAULT_KV_POOL,
        cache_outputs: bool = False,
    ) -> None:
        if kv_pool not in KV_POOLS:
            raise ValueError(f"kv_pool must be one of {KV_POOLS}, not {kv_pool!r}")
        if cache_outputs and kv_pool == "split":
            raise ValueError("cache_outputs needs one KV pool (kv_pool 'preempt' or 'shared')")
        # A finished request's reply stays cached (SimRequest.output_ids), as in vLLM v1.
        self.cache_outputs = cache_outputs
        self.index = index
        self.capacity_tokens = capacity_tokens
        self.cost = cost
        self.cache: KVPool | ChunkLRU = (
            ChunkLRU(capacity_tokens) if kv_pool == "split" else KVPool(capacity_tokens)
        )
        # kv_pool="preempt": running requests in admission order (the last is preempted
        # first), and every request admitted and not finished, running or queued again.
        self.preempts = kv_pool == "preempt"
        self.admitted: dict[int, Progress] = {}
        self.progress: dict[int, Progress] = {}
        self.waiting: deque[SimRequest] = deque()
        # Requests in the prefill step under way (start_batch: one, or several together).
        self.prefilling = 0
        self.running = 0  # prefilling + decoding sequences
        self.running_tokens = 0  # their prompt + output tokens (KV in use)
        # Counters the tests reconcile with the engine's per-request records.
        self.requests = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.prefill_ms = 0.0
        self.peak_in_flight = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        # What vLLM's /metrics says of prefills (request_prefill_time_seconds,
        # request_prefill_kv_computed_tokens): observed when a request finishes, not when its
        # prefill starts, so a router scraping them sees requests in flight lag behind.
        self.finished_prefills = 0
        self.finished_prefill_tokens = 0
        self.finished_prefill_ms = 0.0
        self._prefill_stats: dict[int, list[float]] = {}  # rid: [computed tokens, ms]
        # KV-cache events (vLLM's BlockStored / BlockRemoved), for a router that subscribes
        # (listen_cache_events); None: nobody does. A prompt's blocks are announced when its
        # prefill ends, as vLLM announces blocks once computed; evictions at once.
        self._publish: Callable[[list[tuple[bool, int, int]]], None] | None = None
        self._computing: dict[int, list[tuple[bool, int, int]]] = {}

    def listen_cache_events(self, publish: Callable[[list[tuple[bool, int, int]]], None]) -> None:
        """Call ``publish`` with every batch of (stored, chunk, units held) cache events."""
        if not isinstance(self.cache, KVPool):
            raise ValueError("cache events need one KV pool (kv_pool 'preempt' or 'shared')")
        self._publish = publish
        self.cache.events = []

    def _flush_events(self, computing: int | None = None) -> None:
        """Publish what the pool reported; with ``computing`` (a request whose prefill just
        started), its stored blocks wait for the end of that prefill."""
        if self._publish is None:
            return
        events = self.cache.events
        assert events is not None
        if not events:
            return
        if computing is not None:
            self._computing[computing] = [e for e in events if e[0]]
            events = [e for e in events if not e[0]]
        self.cache.events = []  # type: ignore[union-attr]
        if events:
            self._publish(events)

    @property
    def in_flight(self) -> int:
        return self.running + len(self.waiting)

    def kv_usage(self) -> float:
        """What vLLM exports as KV-cache usage: blocks held by running sequences."""
        held = self.cache.pinned if isinstance(self.cache, KVPool) else self.running_tokens
        return min(1.0, held / self.capacity_tokens)

    def _private(self, request: SimRequest, full: int, last: int) -> int:
        """Units only this request can use: its output and the tail short of a whole block."""
        shared = full * (len(request.ids) - 1) + last
        return request.input_tokens - shared + request.output_tokens

    def _admission_private(self, request: SimRequest, full: int, last: int) -> int:
        """kv_pool="preempt": the private units a request is admitted with: the partial block
        of its prompt, the output blocks it had (after a preemption), or its first one."""
        tail = self._private(request, full, last) - request.output_tokens
        state = self.progress.get(request.rid)
        generated = state.generated if state is not None else 0
        return tail + self._output_units(request, max(1, generated))

    def _output_units(self, request: SimRequest, generated: int) -> int:
        """Units of the output blocks ``generated`` tokens occupy (the last one whole)."""
        block = self.cost.kv_block_tokens
        return min(request.output_tokens, -(-generated // block) * block)

    def _reply_blocks(self, request: SimRequest) -> list[tuple[int, int]]:
        """(chunk, units) of the finished request's reply to keep cached: whole KV blocks
        only, so a partial last chunk keeps what it fills of whole blocks."""
        if not self.cache_outputs:
            return []
        block, left, blocks = self.cost.kv_block_tokens, request.output_tokens, []
        for chunk in request.output_ids:
            tokens = min(request.chunk_tokens, left)
            left -= tokens
            blocks.append((chunk, tokens // block * block))
        return blocks

    def cached_tokens(self, request: SimRequest) -> int:
        full, last = cache_units(request, self.cost.kv_block_tokens)
        return self.cache.match(request.ids, full, last)

    def enqueue(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def can_start(self) -> bool:
        """Whether a prefill step can start now (the head of the queue admitted)."""
        return not self.prefilling and self._admits()

    def _admits(self) -> bool:
        if not self.waiting:
            return False
        if self.running == 0:
            return True
        if self.running >= self.cost.max_batch:
            return False
        head = self.waiting[0]
        if isinstance(self.cache, KVPool):
            full, last = cache_units(head, self.cost.kv_block_tokens)
            private = (
                self._admission_private(head, full, last)
                if self.preempts
                else self._private(head, full, last)
            )
            need = self.cache.pin_cost(head.ids, full, last, private)
            return self.cache.pinned + need <= self.capacity_tokens
        need = head.input_tokens + head.output_tokens
        return self.running_tokens + need <= self.capacity_tokens

    def _prompt_to_compute(self, request: SimRequest) -> int:
        """The tokens its prefill computes over: the prompt, and after a preemption the
        output it had produced too."""
        state = self.progress.get(request.rid) if self.preempts else None
        return request.input_tokens + (state.generated if state is not None else 0)

    def _held(self, request: SimRequest) -> int:
        """Its cached prefix (a read: the cache is refreshed only when it is admitted)."""
        full, last = cache_units(request, self.cost.kv_block_tokens)
        return self.cache.match(request.ids, full, last)

    def _uncached(self, request: SimRequest, held: int) -> int:
        """The tokens its prefill computes: at least one, as vLLM computes the last."""
        return max(1, self._prompt_to_compute(request) - held)

    def start_batch(self) -> tuple[list[tuple[SimRequest, int]], float]:
        """Start a prefill step (can_start first): the head of the queue, then, FIFO, the
        requests after it that are admitted and whose uncached tokens fit in what is left of
        prefill_batch_tokens, as vLLM's scheduler fills a step; the first that does not fit
        ends it (vLLM would start it chunked; here it waits whole for the next step). The
        step pays the fixed cost once; every request in it takes the step's time to its
        first token and counts it as its prefill time, as vLLM's
        request_prefill_time_seconds does. ([(request, hit)], step ms)"""
        # The step's token budget: what the decoding requests (one token each) leave. Every
        # request computes at least one token, so a budget spent (or 0) looks up no more.
        # Each request's prefix is looked up once, for the budget and for its admission.
        budget = self.cost.prefill_batch_tokens
        head = self.waiting[0]
        held = self._held(head)
        left = budget - self.running - self._uncached(head, held) if budget else 0
        first, hit, step = self.start_prefill(held=held)
        members, own = [(first, hit)], [step]
        while left > 0 and self._admits():
            nxt = self.waiting[0]
            held = self._held(nxt)
            need = self._uncached(nxt, held)
            if need > left:
                break
            request, hit, ms = self.start_prefill(joining=True, held=held)
            members.append((request, hit))
            own.append(ms)
            step += ms
            left -= need
        for (request, _), ms in zip(members, own, strict=True):
            self._prefill_stats[request.rid][1] += step - ms
        return members, step

    def start_prefill(
        self, joining: bool = False, held: int | None = None
    ) -> tuple[SimRequest, int, float]:
        """Admit the head of the queue: look up and refresh its prefix; (request, hit, ms).
        ``joining``: into the prefill step started before (start_batch), which already pays
        the step's fixed cost: ms is what the request adds to it. ``held``: its prefix as
        start_batch has just looked it up (the cache has not changed since).
        Under kv_pool="preempt" a preempted request's recomputation is not counted as a new
        request (hit 0 is returned for it: its hit was counted at its first admission)."""
        request = self.waiting.popleft()
        full, last = cache_units(request, self.cost.kv_block_tokens)
        hit = self._held(request) if held is None else held
        tokens, first = self._prompt_to_compute(request), True
        if self.preempts:
            # Admitted before (counted in the replica's counters) while it has progress.
            first = request.rid not in self.progress
            state = self.progress.setdefault(request.rid, Progress(request))
            state.prefilling = True
            state.private = self._admission_private(request, full, last)
            if not first:
                self.recomputed_tokens += tokens - hit
            whole = hit == full * (len(request.ids) - 1) + last
            state.cached_chunks = len(request.ids) if whole else hit // max(1, full)
            self.cache.pin(request.ids, full, last, state.private)
            self._flush_events(computing=request.rid)
            self.admitted[request.rid] = state
        elif isinstance(self.cache, KVPool):
            self.cache.pin(request.ids, full, last, self._private(request, full, last))
            self._flush_events(computing=request.rid)
        else:
            self.cache.touch(request.ids, full, last)
        if joining:
            duration = self.cost.prefill_tokens_ms(tokens, hit)
        else:
            duration = self.cost.prefill_ms(tokens, hit)
        self.prefilling += 1
        self.running += 1
        self.running_tokens += request.input_tokens + request.output_tokens
        self.prefill_ms += duration
        stats = self._prefill_stats.setdefault(request.rid, [0.0, 0.0])
        stats[1] += duration
        if first:
            stats[0] = request.input_tokens - hit
            self.requests += 1
            self.prompt_tokens += request.input_tokens
            self.hit_tokens += hit
        return request, hit if first else 0, duration

    def end_prefill(self, request: SimRequest, now_ms: float = 0.0) -> float:
        """The request's first token is out; returns its decode duration in ms (under
        kv_pool="preempt", its decode step: the engine schedules its blocks by it)."""
        self.prefilling -= 1
        computed = self._computing.pop(request.rid, None)
        if computed and self._publish is not None:
            self._publish(computed)
        step = self.cost.decode_step_ms(self.running, self.running_tokens)
        if self.preempts:
            state = self.progress[request.rid]
            state.prefilling = False
            state.generated = max(1, state.generated)
            state.step_ms = step
            state.at_ms = now_ms
            return step
        return step * max(0, request.output_tokens - 1)

    def next_block(self, request: SimRequest) -> int:
        """kv_pool="preempt": the output token that needs a new block next (0: none, the
        request finishes at its last token)."""
        state = self.progress[request.rid]
        block = self.cost.kv_block_tokens
        after = -(-state.generated // block) * block + 1
        return after if after <= request.output_tokens else 0

    def grow(self, request: SimRequest, generated: int, now_ms: float) -> bool:
        """kv_pool="preempt": the request produced token ``generated``, which needs a new
        output block. Take it, preempting the most recently admitted running requests while
        the pool has none free; False if the request itself was preempted (it was the newest).
        A request running alone grows past the pool rather than preempt itself."""
        state = self.progress[request.rid]
        state.generated = generated
        state.at_ms = now_ms
        need = self._output_units(request, generated) - self._output_units(request, generated - 1)
        pool = self.cache
        assert isinstance(pool, KVPool)
        while pool.pinned + need > self.capacity_tokens and self.running > 1:
            victim = next(reversed(self.admitted.values()))
            self._preempt(victim, now_ms)
            if victim is state:
                return False
        state.private += need
        pool.grow(need)
        self._flush_events()
        return True

    def _preempt(self, state: Progress, now_ms: float) -> None:
        request = state.request
        if not state.prefilling and state.step_ms > 0:
            # The tokens it decoded since its last block: recomputed, not lost.
            done = int((now_ms - state.at_ms) / state.step_ms)
            state.generated = min(request.output_tokens, state.generated + max(0, done))
        del self.admitted[request.rid]
        pool = self.cache
        assert isinstance(pool, KVPool)
        pool.release(request.ids, state.private)
        state.private = 0
        state.epoch += 1
        if state.prefilling:
            # Stopped mid-prefill: what it was computing is not cached (the sim's prefill is
            # one step, so none of it).
            pool.forget(request.ids[state.cached_chunks :])
            # Not computed, so not announced, unless another running request still holds
            # a chunk (it met it cached): that one stays, and so does its announcement.
            computing = self._computing.pop(request.rid, [])
            if pool.events is not None:
                pool.events.extend(e for e in computing if e[1] in pool)
            state.prefilling = False
            self.prefilling -= 1
        self.running -= 1
        self.running_tokens -= request.input_tokens + request.output_tokens
        self.waiting.appendleft(request)
        self.preemptions += 1
        self._flush_events()

    def epoch(self, request: SimRequest) -> int:
        """The request's preemption count; -1 once it finished (every event left is stale)."""
        state = self.progress.get(request.rid)
        return state.epoch if state is not None else -1

    def finish(self, request: SimRequest) -> None:
        if self.preempts:
            state = self.progress.pop(request.rid)
            del self.admitted[request.rid]
            self.cache.release(  # type: ignore[union-attr]
                request.ids, state.private, self._reply_blocks(request)
            )
        elif isinstance(self.cache, KVPool):
            full, last = cache_units(request, self.cost.kv_block_tokens)
            self.cache.release(
                request.ids, self._private(request, full, last), self._reply_blocks(request)
            )
        self._flush_events()
        self.running -= 1
        self.running_tokens -= request.input_tokens + request.output_tokens
        computed, ms = self._prefill_stats.pop(request.rid)
        self.finished_prefills += 1
        self.finished_prefill_tokens += int(computed)
        self.finished_prefill_ms += ms
