"""Model pools: a request goes only to endpoints serving its model (extproc/model_pools.py,
the model lists read by extproc/served_models.py, wired in extproc/serve.py)."""

from __future__ import annotations

import asyncio
import itertools

import orjson
import pytest

from extproc.config import ConfigError, EndpointConfig, RoutingConfig, load_config
from extproc.prompt import NotRoutable, parse_request
from extproc.router import Router
from extproc.served_models import ModelLister, parse_model_list

A = [f"10.0.0.{i}:8000" for i in (1, 2)]
B = ["10.0.0.3:8000"]


def chat(model: str, text: str):
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    return parse_request("chat", orjson.dumps(body))


_asked = itertools.count()


def _placed(router: Router, model: str, n: int = 40) -> set[str]:
    """Where n new questions (none asked before: no prefix held anywhere) went."""
    placed = set()
    for _ in range(n):
        decision = router.route(chat(model, f"question {next(_asked)} " * 30))
        router.finish(decision)
        placed.add(decision.endpoint)
    return placed


def test_a_request_goes_only_to_endpoints_serving_its_model():
    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in A + B])
    assert _placed(router, "b") == set(A + B)  # no list known: anywhere, as before
    for address in A:
        router.observe_models(address, frozenset({"a", "a-lora"}))
    router.observe_models(B[0], frozenset({"b"}))
    assert _placed(router, "b") == set(B)
    assert _placed(router, "a") == set(A)
    assert _placed(router, "a-lora") == set(A)  # an adapter is a model name of its own
    assert _placed(router, "") == set(A + B)  # no model named: the server's default
    with pytest.raises(NotRoutable) as raised:
        router.route(chat("c", "who serves me? " * 30))
    assert raised.value.kind == "unknown_model"
    # Its pool down: no endpoint for it (the server answers 503), not another model's.
    router.set_health(B[0], False)
    assert router.route(chat("b", "anyone? " * 30)).endpoint is None


def test_unreadable_lists_get_any_model_and_new_endpoints_wait_for_theirs():
    """An endpoint whose list cannot be read (an API key on /v1/models, an old server) is
    sent any model, as before pools existed; one not asked yet is left out of a model's
    pool while other endpoints are known to serve it; a failed read keeps the last list."""
    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in A + B])
    router.observe_models(A[0], frozenset({"a"}))
    assert _placed(router, "a") == {A[0]}  # A[1], B: not asked yet
    assert _placed(router, "c") == {A[1], B[0]}  # none known to serve it: those that may
    router.observe_models(B[0], None)
    assert _placed(router, "a") == {A[0], B[0]}
    router.observe_models(A[1], frozenset({"b"}))
    assert _placed(router, "c") == {B[0]}
    router.observe_models(B[0], frozenset({"b"}))  # every list known now
    with pytest.raises(NotRoutable):
        router.route(chat("c", "x " * 40))
    # Configured models are kept whatever is read; an endpoint that stays keeps its list.
    configured = [EndpointConfig(address=A[0], models=("a",)), EndpointConfig(address=A[1])]
    router.set_endpoints(configured)
    router.observe_models(A[0], frozenset({"z"}))
    assert router.served_models() == {A[0]: frozenset({"a"}), A[1]: frozenset({"b"})}
    assert _placed(router, "a") == {A[0]}


def test_model_lists_are_parsed_strictly():
    page = {"object": "list", "data": [{"id": "m"}, {"id": "lora-1", "parent": "m"}]}
    assert parse_model_list(orjson.dumps(page).decode()) == {"m", "lora-1"}
    for bad in ("[]", '{"data": {}}', '{"data": [{"id": ""}]}', '{"data": [1]}', "nan"):
        with pytest.raises(ValueError):
            parse_model_list(bad)


async def test_the_lister_reads_real_model_lists_and_the_service_routes_by_them():
    """Stand-in replicas (the vLLM-shaped /v1/models) of two models behind one router
    service: once their lists are read, each model's requests reach only its replicas."""
    from extproc.fake_replica import ReplicaSettings, start_replica
    from extproc.serve import RouterService

    runners, addresses = [], {}
    for name, model in (("r1", "a"), ("r2", "a"), ("r3", "b")):
        runner, port = await start_replica(ReplicaSettings(name=name, model=model, port=0))
        runners.append(runner)
        addresses[f"127.0.0.1:{port}"] = model
    cfg = load_config(
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.admin_listen": "",
            "endpoints": ",".join(addresses),
            "health.enabled": False,
            "signals.enabled": False,
            "models.interval_seconds": 0.1,
        },
        environ={},
    )
    svc = RouterService(cfg)
    await svc.start()
    try:
        for _ in range(50):
            if all(svc.router.served_models().values()):
                break
            await asyncio.sleep(0.05)
        assert svc.router.served_models() == {a: frozenset({m}) for a, m in addresses.items()}
        for model in ("a", "b"):
            pool = {a for a, m in addresses.items() if m == model}
            assert _placed(svc.router, model) == pool
        svc.metrics.refresh(svc.router)
        for address, model in addresses.items():
            assert svc.metrics.endpoint_model.labels(address, model)._value.get() == 1
        # A list that can no longer be read keeps the last one.
        svc.model_lister.record(next(iter(addresses)), None)
        assert all(svc.router.served_models().values())
    finally:
        await svc.stop(0)
        for runner in runners:
            await runner.cleanup()


def test_an_empty_model_name_is_refused_in_the_config():
    with pytest.raises(ConfigError, match=r"endpoints\.0\.models"):
        load_config(None, {"endpoints": [{"address": A[0], "models": [" "]}]}, environ={})


def test_the_lister_polls_nothing_when_disabled():
    cfg = load_config(None, {"models.enabled": False}, environ={})
    lister = ModelLister(cfg.models, lambda: A, lambda address, models: None)
    lister.start()
    assert lister._task is None
