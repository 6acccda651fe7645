"""Which endpoints serve which model: the pool a request may go to.

Kept by endpoint position (the router's arrays' order), with one boolean mask per model
name built when a list changes, so a decision costs a dict lookup and an ``or``.

An endpoint is in one of three states: its models are known (configured, or read from its
model list), it could not tell (its list unreadable, empty or too long: it is sent any
model, as before pools existed), or it was not asked yet (new: it is left out of a model's
pool while a healthy endpoint is known to serve that model, and used as before otherwise).

Pools exist only where the known lists differ. With one list everywhere (one model, or
servers that ignore ``model``: TGI's clients send "tgi") a model no list names goes
anywhere, as before: the server decides.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .prompt import NotRoutable

UNASKED, ANY_MODEL, KNOWN = 0, 1, 2


class ModelPools:
    def __init__(self) -> None:
        self._state = np.zeros(0, dtype=np.int8)
        self._models: list[frozenset[str]] = []
        self._fixed: list[bool] = []  # configured: a model list read does not change it
        self._masks: dict[str, np.ndarray] = {}
        self._any = np.zeros(0, dtype=bool)  # sent any model (unreadable list)
        self._open = np.zeros(0, dtype=bool)  # unreadable or not asked yet
        self._unasked = np.zeros(0, dtype=bool)
        self._pools = 0  # distinct model lists known

    def set_endpoints(self, configured: Sequence[tuple[str, ...]], kept: Sequence[int]) -> None:
        """The endpoint list changed: ``configured`` models per new position (empty: to be
        read) and each new position's old one (-1: added)."""
        state = np.zeros(len(configured), dtype=np.int8)
        models: list[frozenset[str]] = []
        for i, (names, old) in enumerate(zip(configured, kept, strict=True)):
            if names:
                state[i] = KNOWN
                models.append(frozenset(names))
            elif old >= 0 and not self._fixed[old]:
                state[i] = self._state[old]
                models.append(self._models[old])
            else:
                models.append(frozenset())
        self._state, self._models = state, models
        self._fixed = [bool(names) for names in configured]
        self._rebuild()

    def observe(self, i: int, models: frozenset[str] | None) -> bool:
        """A model list read from endpoint ``i`` (None: it could not be read); whether
        anything changed."""
        if self._fixed[i]:
            return False
        state = ANY_MODEL if models is None else KNOWN
        models = models or frozenset()
        if state == self._state[i] and models == self._models[i]:
            return False
        self._state[i], self._models[i] = state, models
        self._rebuild()
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

    def eligible(self, model: str, healthy: np.ndarray) -> np.ndarray | None:
        """The positions a request for ``model`` may go to; None: any (no endpoint's models
        are known, a single list is, or the request names none: the server then uses its
        default). Endpoints not asked yet join a model's pool when none of it is
        ``healthy``. Raises NotRoutable("unknown_model") when the lists differ, every
        endpoint's is known and none names the model: passed through, its server answers
        (vLLM: 404, the model does not exist)."""
        if not model or self._pools == 0:
            return None
        mask = self._masks.get(model)
        if mask is not None:
            pool = mask | self._any
            return pool if (pool & healthy).any() else pool | self._unasked
        if self._pools == 1:
            return None
        if not self._open.any():
            raise NotRoutable("unknown_model")
        return self._open

    def served(self, i: int) -> frozenset[str] | None:
        """Endpoint ``i``'s models; None while not known."""
        return self._models[i] if self._state[i] == KNOWN else None
