"""Which endpoints serve which model: the pool a request may go to.

Kept by endpoint position (the router's arrays' order), with one boolean mask per model
name built when a list changes, so a decision costs a dict lookup and an ``or``.

An endpoint is in one of three states: its models are known (configured, or read from its
model list), it could not tell (its list unreadable, empty or too long: it is sent any
model, as before pools existed), or it was not asked yet (new: it is left out of a model's
pool while a healthy endpoint is known to serve that model, and used as before otherwise;
its list is read within ~0.1 s).

Pools exist only where the known lists differ. With one list everywhere (one model, or
servers that ignore ``model``: TGI's clients send "tgi") a model no list names goes
anywhere, as before: the server decides. A model no list names has the lists read again at
once (``unlisted``, ``take_unknown``; the service limits how often), and its request waits
for that read (``models.unknown_wait_seconds``): a LoRA adapter loaded at run time (vLLM's
``/v1/load_lora_adapter``) is routed to its servers from its first request, not at the next
round.

Endpoints that left (a pod that failed its readiness probe leaves the discovered set) are
remembered for REMEMBER_SECONDS: one that comes back starts with its last list, and a
model none of the remaining endpoints serves has no endpoint (the router's 503, which
clients retry) rather than going to another model's servers (their 404).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .prompt import NotRoutable

UNASKED, ANY_MODEL, KNOWN = 0, 1, 2
REMEMBER_SECONDS = 600.0
# Unknown model names kept until the service takes them (every 0.1 s at most a second late).
MAX_PENDING_UNKNOWN = 64


class ModelPools:
    def __init__(self) -> None:
        self._addresses: list[str] = []
        self._state = np.zeros(0, dtype=np.int8)
        self._models: list[frozenset[str]] = []
        self._fixed: list[bool] = []  # configured: a model list read does not change it
        self._lists_read = False  # some endpoint's models come from its list
        self._masks: dict[str, np.ndarray] = {}
        self._any = np.zeros(0, dtype=bool)  # sent any model (unreadable list)
        self._open = np.zeros(0, dtype=bool)  # unreadable or not asked yet
        self._unasked = np.zeros(0, dtype=bool)
        self._pools = 0  # distinct model lists known
        # Endpoints that left: address -> (their last list read, when they left).
        self._departed: dict[str, tuple[frozenset[str], float]] = {}
        self._departed_models: dict[str, float] = {}  # model -> when its last server left
        # Models asked for that no list read names (an adapter loaded at run time, maybe),
        # not yet taken: the service reads the lists again at once (``take_unknown``).
        self._unknown: set[str] = set()

    def set_endpoints(
        self,
        addresses: Sequence[str],
        configured: Sequence[tuple[str, ...]],
        kept: Sequence[int],
        now: float,
    ) -> None:
        """The endpoint list changed: ``configured`` models per new position (empty: to be
        read), each new position's old one (-1: added), ``now`` on the router's clock."""
        kept_old = {old for old in kept if old >= 0}
        for old, address in enumerate(self._addresses):
            if old not in kept_old and self._state[old] == KNOWN:
                self._departed[address] = (self._models[old], now)
        self._departed = {
            a: (m, t) for a, (m, t) in self._departed.items() if now - t < REMEMBER_SECONDS
        }
        state = np.zeros(len(configured), dtype=np.int8)
        models: list[frozenset[str]] = []
        for i, (address, names, old) in enumerate(zip(addresses, configured, kept, strict=True)):
            if names:
                state[i] = KNOWN
                models.append(frozenset(names))
            elif old >= 0 and not self._fixed[old]:
                state[i] = self._state[old]
                models.append(self._models[old])
            elif address in self._departed:  # back: its last list until it is read again
                state[i] = KNOWN
                models.append(self._departed.pop(address)[0])
            else:
                models.append(frozenset())
        self._addresses = list(addresses)
        self._state, self._models = state, models
        self._fixed = [bool(names) for names in configured]
        self._lists_read = not all(self._fixed)
        self._rebuild()
        served = set(self._masks)
        self._departed_models = {}
        for departed, left in self._departed.values():
            for model in departed - served:
                self._departed_models[model] = max(left, self._departed_models.get(model, left))

    def observe(self, i: int, models: frozenset[str] | None) -> bool:
        """A model list read from endpoint ``i`` (None: any model may go there); whether
        anything changed."""
        if self._fixed[i]:
            return False
        state = ANY_MODEL if models is None else KNOWN
        models = models or frozenset()
        if state == self._state[i] and models == self._models[i]:
            return False
        self._state[i], self._models[i] = state, models
        self._rebuild()
        for model in models:
            self._departed_models.pop(model, None)
        return True

    def _rebuild(self) -> None:
        count = len(self._models)
        masks: dict[str, np.ndarray] = {}
        for i, names in enumerate(self._models):
            if self._state[i] == KNOWN:
                for name in names:
                    mask = masks.get(name)
                    if mask is None:
                        mask = masks[name] = np.zeros(count, dtype=bool)
                    mask[i] = True
        self._masks = masks
        self._any = self._state == ANY_MODEL
        self._open = self._state != KNOWN
        self._unasked = self._state == UNASKED
        self._pools = len({m for i, m in enumerate(self._models) if self._state[i] == KNOWN})

    def eligible(self, model: str, healthy: np.ndarray, now: float) -> np.ndarray | None:
        """The positions a request for ``model`` may go to; None: any (no endpoint's models
        are known, a single list is, or the request names none: the server then uses its
        default). Endpoints not asked yet join a model's pool when none of it is
        ``healthy``; a model whose servers all left lately has none (all False). Raises
        NotRoutable("unknown_model") when the lists differ, every endpoint's is known and
        none names the model: passed through, its server answers (vLLM: 404, the model
        does not exist)."""
        if not model or self._pools == 0:
            return None
        mask = self._masks.get(model)
        if mask is not None:
            pool = mask | self._any
            return pool if (pool & healthy).any() else pool | self._unasked
        left = self._departed_models.get(model)
        if left is not None and now - left < REMEMBER_SECONDS:
            return self._any | self._unasked  # (only those may serve it now: else a 503)
        if len(self._unknown) < MAX_PENDING_UNKNOWN:
            self._unknown.add(model)
        if self._pools == 1:
            return None
        if not self._open.any():
            raise NotRoutable("unknown_model")
        return self._open

    def unlisted(self, model: str, now: float) -> bool:
        """Whether ``model`` is named by no list read while some list is known (not when the
        request names none, nor for a model whose servers all left lately, nor where every
        endpoint's models are configured): its request may wait for the lists read again
        (``ModelLister.read_again_for``)."""
        if not model or self._pools == 0 or model in self._masks or not self._lists_read:
            return False
        left = self._departed_models.get(model)
        return left is None or now - left >= REMEMBER_SECONDS

    def take_unknown(self) -> set[str]:
        """The models asked for since the last call that no list names."""
        models, self._unknown = self._unknown, set()
        return models

    def served(self, i: int) -> frozenset[str] | None:
        """Endpoint ``i``'s models; None while not known."""
        return self._models[i] if self._state[i] == KNOWN else None
