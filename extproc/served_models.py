"""Which models each endpoint serves, read from its OpenAI-style model list.

vLLM, SGLang and TGI answer ``GET /v1/models`` with ``{"data": [{"id": ...}, ...]}``: vLLM
lists every ``--served-model-name`` and each LoRA adapter it has loaded. The router sends a
request only to endpoints serving its ``model``, so one router (and one Envoy cluster)
serves several model pools; an endpoint whose list cannot be read is sent any model, as
before this existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping

import aiohttp
import orjson

from .config import ConfigError, ModelsConfig
from .model_pools import MAX_PENDING_UNKNOWN
from .poller import EndpointPoller, fetch_parsed

log = logging.getLogger(__name__)

# A list longer than this is read as "any model" (an endpoint with thousands of adapters,
# rather than a mask per adapter), as is an empty one.
MAX_MODELS = 4096
# How often the list of an endpoint not asked yet (just discovered, or restarted) is looked
# for between rounds: it gets no request for a model others are known to serve until read.
NEW_ENDPOINT_SECONDS = 0.1
# A model no list names has every list read again, for one name at most this often.
UNKNOWN_MODEL_SECONDS = 10.0
# Reads of every list after the one a request started, for the names that joined it (each
# such read also serves the names that joined the one before; the last one's are let go).
FOLLOW_UP_READS = 2
# A model list page larger than this is not read.
MAX_LIST_BYTES = 4 * 2**20


def parse_model_list(text: str) -> frozenset[str]:
    """The model ids of an OpenAI-style list, empty for an empty or too long one (then any
    model may go there); ValueError for anything else."""
    page = orjson.loads(text)
    data = page.get("data") if isinstance(page, dict) else None
    if not isinstance(data, list):
        raise ValueError("not a model list")
    if len(data) > MAX_MODELS:
        return frozenset()
    ids = [card.get("id") if isinstance(card, dict) else None for card in data]
    if not all(isinstance(i, str) and i for i in ids):
        raise ValueError("a model without an id")
    return frozenset(ids)


def auth_headers(config: ModelsConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The bearer token header the lists need, from ``models.api_key_env``; a ConfigError
    naming the field when that variable is not set (checked at start-up)."""
    if not config.api_key_env:
        return {}
    key = environ.get(config.api_key_env, "")
    if not key:
        raise ConfigError(
            f"config field models.api_key_env: environment variable {config.api_key_env} is not set"
        )
    return {"Authorization": f"Bearer {key}"}


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("reading the model lists again failed", exc_info=task.exception())


class ModelLister(EndpointPoller["frozenset[str] | None"]):
    """Reads every endpoint's model list on a timer, and at once a new endpoint's or one
    ``unpolled`` (its server restarted, or discovery brought it back); ``on_models(address,
    ids)`` gets each answer, None where any model may go there (its list empty, too long, or
    unreadable; a failed read after a good one keeps the last list: an overloaded server
    still serves what it served)."""

    task_name = "endpoint-models"
    new_address_seconds = NEW_ENDPOINT_SECONDS

    def __init__(
        self,
        config: ModelsConfig,
        addresses: Callable[[], list[str]],
        on_models: Callable[[str, frozenset[str] | None], None],
        unknown_models: Callable[[], set[str]] = set,
    ) -> None:
        super().__init__(addresses, config.interval_seconds, config.timeout_seconds)
        self.config = config
        self._unknown_models = unknown_models
        self._asked: dict[str, float] = {}  # unknown model -> when it had the lists read
        self._read_all_at = -math.inf
        # A read of every list a request waits for (``read_again_for``), and per name the
        # future its requests wait on: done once a list names it, or every list answered.
        self._reading: asyncio.Task[None] | None = None
        self._reading_for: dict[str, asyncio.Future[None]] = {}
        self._stopping = False
        self._headers = auth_headers(config) if config.enabled else {}
        self._on_models = on_models
        self.latest: dict[str, frozenset[str] | None] = {}

    def wants_all(self) -> bool:
        """A request named a model no list names (an adapter loaded since the last read,
        maybe): every list is read again at once, at most once a second, and for one name
        once in UNKNOWN_MODEL_SECONDS (a client sending a name no server serves, or TGI's
        "tgi", costs one read of each list that often; another name is not held up by
        it)."""
        now = time.monotonic()
        if now - self._read_all_at < 1.0:
            return False  # (the names wait for the next check)
        fresh = {
            m
            for m in self._unknown_models()
            if now - self._asked.get(m, -math.inf) >= UNKNOWN_MODEL_SECONDS
        }
        if not fresh:
            return False
        self._note_asked(fresh, now)
        log.info(
            "models %s are in no list read: reading every endpoint's list again", sorted(fresh)
        )
        return True

    def read_again_for(self, model: str) -> asyncio.Future[None] | None:
        """A request names ``model``, which no list read names (an adapter loaded at run
        time, maybe): every list is read again now and the request waits on the returned
        future (the caller bounds the wait), done as soon as a list names the model, or
        once every list answered. So a just-loaded adapter's first request goes to its
        server, not by its prefix to one that answers 404.

        None (no wait: the request is routed as it is) when the lists are not being read
        (disabled, or stopping); when this name had them read within UNKNOWN_MODEL_SECONDS
        and no read for it is under way (TGI's "tgi", a typo: the requests of one read
        wait, then none for that time); when another name had them read less than a
        second ago and that read is over (this one's comes at the next check,
        ``wants_all``); or when MAX_PENDING_UNKNOWN names wait already. A name asked while
        a read started for another is under way waits for that read, and if it did not
        list the name, for one more right after it (that read may have asked the name's
        server before it loaded the adapter): FOLLOW_UP_READS at most, one asked during
        the last is let go at its end (and read at the next check).
        """
        session = self.session
        if self._stopping or session is None or session.closed:
            return None
        waiting = self._reading_for.get(model)
        if waiting is not None:
            return waiting
        now = time.monotonic()
        if now - self._asked.get(model, -math.inf) < UNKNOWN_MODEL_SECONDS:
            return None
        loop = asyncio.get_running_loop()
        if self._reading is not None:  # started for another name, before this request
            if len(self._reading_for) >= MAX_PENDING_UNKNOWN:
                return None
            waiting = self._reading_for[model] = loop.create_future()
            return waiting
        if now - self._read_all_at < 1.0:
            return None
        self._note_asked({model}, now)
        log.info("model %r is in no list read: reading every endpoint's list again", model)
        waiting = self._reading_for[model] = loop.create_future()
        self._reading = loop.create_task(self._read_every_list(session, model), name=self.task_name)
        self._reading.add_done_callback(_log_failure)
        return waiting

    def _note_asked(self, models: set[str], now: float) -> None:
        if len(self._asked) >= MAX_MODELS:
            self._asked = {m: t for m, t in self._asked.items() if now - t < UNKNOWN_MODEL_SECONDS}
        for model in models:
            self._asked[model] = now
        self._read_all_at = now

    async def _read_every_list(self, session: aiohttp.ClientSession, started_for: str) -> None:
        """Every list read for ``started_for`` (and the names that joined meanwhile; those
        it did not list get one more read), each waiting request let go as soon as a list
        names its model, the rest at the end."""

        async def read(address: str) -> None:
            self._let_go(await self._poll_and_record(session, address) or ())

        try:
            await asyncio.gather(*(read(a) for a in self._addresses()))
            read_for = {started_for}
            self._let_go(read_for)
            for _ in range(FOLLOW_UP_READS):
                joined = {m for m, w in self._reading_for.items() if not w.done()} - read_for
                if not joined:
                    break
                self._note_asked(joined, time.monotonic())
                read_for |= joined
                await asyncio.gather(*(read(a) for a in self._addresses()))
                self._let_go(joined)
        finally:
            self._release_waiting()

    def _let_go(self, models: Iterable[str]) -> None:
        """The requests for ``models`` go on (a list names them, or a read for them is
        over)."""
        for model in models:
            waiting = self._reading_for.get(model)
            if waiting is not None and not waiting.done():
                waiting.set_result(None)

    def _release_waiting(self) -> None:
        self._let_go(set(self._reading_for))
        self._reading_for = {}
        self._reading = None

    def start(self) -> None:
        self._stopping = False
        if self.config.enabled:
            super().start()

    async def stop(self) -> None:
        self._stopping = True  # (no read starts now: the session is about to close)
        reading = self._reading
        if reading is not None:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
        self._release_waiting()  # (a read cancelled before it ran has not let them go)
        await super().stop()

    async def poll(self, session: aiohttp.ClientSession, address: str) -> frozenset[str] | None:
        url = f"http://{address}{self.config.path}"
        return await fetch_parsed(
            session, url, parse_model_list, MAX_LIST_BYTES, headers=self._headers
        )

    def forget(self, gone: set[str]) -> None:
        for address in gone:
            self.latest.pop(address, None)

    def record(self, address: str, models: frozenset[str] | None) -> None:
        previous = self.latest.get(address)
        if models is None and previous is not None:
            return  # keep the last list read
        if models is not None and not models:
            models = None  # empty or too long: any model
        # (The router logs each list it takes: only why there is none is said here.)
        if models is None and (previous is not None or address not in self.latest):
            log.warning(
                "the model list of %s (%s) could not be read, or names none or too many: "
                "any model may go there",
                address,
                self.config.path,
            )
        self.latest[address] = models
        self._on_models(address, models)
