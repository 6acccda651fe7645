"""Which models each endpoint serves, read from its OpenAI-style model list.

vLLM, SGLang and TGI answer ``GET /v1/models`` with ``{"data": [{"id": ...}, ...]}``: vLLM
lists every ``--served-model-name`` and each LoRA adapter it has loaded. The router sends a
request only to endpoints serving its ``model``, so one router (and one Envoy cluster)
serves several model pools; an endpoint whose list cannot be read is sent any model, as
before this existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp
import orjson

from .config import ModelsConfig
from .poller import EndpointPoller, fetch_parsed

log = logging.getLogger(__name__)

# A list longer than this is not read (an endpoint with thousands of adapters is read as
# serving any model rather than making every decision's mask that large).
MAX_MODELS = 4096
# A model list page larger than this is not read.
MAX_LIST_BYTES = 4 * 2**20


def parse_model_list(text: str) -> frozenset[str]:
    """The model ids of an OpenAI-style list; ValueError for anything else."""
    page = orjson.loads(text)
    data = page.get("data") if isinstance(page, dict) else None
    if not isinstance(data, list) or len(data) > MAX_MODELS:
        raise ValueError("not a model list")
    ids = [card.get("id") if isinstance(card, dict) else None for card in data]
    if not all(isinstance(i, str) and i for i in ids):
        raise ValueError("a model without an id")
    return frozenset(ids)


class ModelLister(EndpointPoller["frozenset[str] | None"]):
    """Reads every endpoint's model list on a timer; ``on_models(address, ids)`` gets each
    answer, None where the list could not be read (a failed read after a good one keeps
    the last list: an overloaded server still serves what it served)."""

    task_name = "endpoint-models"

    def __init__(
        self,
        config: ModelsConfig,
        addresses: Callable[[], list[str]],
        on_models: Callable[[str, frozenset[str] | None], None],
    ) -> None:
        super().__init__(addresses, config.interval_seconds, config.timeout_seconds)
        self.config = config
        self._on_models = on_models
        self.latest: dict[str, frozenset[str] | None] = {}

    def start(self) -> None:
        if self.config.enabled:
            super().start()

    async def poll(self, session: aiohttp.ClientSession, address: str) -> frozenset[str] | None:
        url = f"http://{address}{self.config.path}"
        return await fetch_parsed(session, url, parse_model_list, MAX_LIST_BYTES)

    def forget(self, gone: set[str]) -> None:
        for address in gone:
            self.latest.pop(address, None)

    def record(self, address: str, models: frozenset[str] | None) -> None:
        previous = self.latest.get(address)
        if models is None and previous is not None:
            return  # keep the last list read
        if models != previous or address not in self.latest:
            if models is None:
                log.warning(
                    "the model list of %s could not be read (%s): any model may go there",
                    address,
                    self.config.path,
                )
            else:
                log.info("%s serves %s", address, ", ".join(sorted(models)))
        self.latest[address] = models
        self._on_models(address, models)
