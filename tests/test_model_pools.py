"""Model pools: a request goes only to endpoints serving its model (extproc/model_pools.py,
the model lists read by extproc/served_models.py, wired in extproc/serve.py)."""

from __future__ import annotations

import asyncio
import itertools
import types

import orjson
import pytest

from extproc.config import ConfigError, EndpointConfig, RoutingConfig, load_config
from extproc.prompt import NotRoutable, parse_request
from extproc.router import Router
from extproc.serve import RouterService
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
    pool while a healthy endpoint is known to serve it, and joins it when none is."""
    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in A + B])
    router.observe_models(A[0], frozenset({"a"}))
    assert _placed(router, "a") == {A[0]}  # A[1], B: not asked yet
    assert _placed(router, "c") == set(A + B)  # one list known: no pools, the server decides
    router.set_health(A[0], False)
    assert _placed(router, "a") == {A[1], B[0]}  # its pool down: those not asked yet
    router.set_health(A[0], True)
    router.observe_models(A[1], frozenset({"b"}))  # two pools now
    assert _placed(router, "c") == {B[0]}  # no list names it: the one not asked
    router.observe_models(B[0], None)  # unreadable
    assert _placed(router, "a") == {A[0], B[0]}
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


def test_servers_that_ignore_the_model_name_are_routed_as_before():
    """TGI's clients send "model": "tgi" and its list names the real model; with one list
    everywhere there are no pools to choose between, so such requests are routed (by
    prefix, as before), not passed through."""
    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in A + B])
    for address in A + B:
        router.observe_models(address, frozenset({"mistralai/Mistral-7B-Instruct-v0.3"}))
    assert _placed(router, "tgi") == set(A + B)
    first = router.route(chat("tgi", "the same conversation " * 40))
    router.finish(first)
    again = router.route(chat("tgi", "the same conversation " * 40))
    assert again.endpoint == first.endpoint and again.matched_blocks > 0


def test_model_lists_are_parsed_strictly():
    page = {"object": "list", "data": [{"id": "m"}, {"id": "lora-1", "parent": "m"}]}
    assert parse_model_list(orjson.dumps(page).decode()) == {"m", "lora-1"}
    for bad in ("[]", '{"data": {}}', '{"data": [{"id": ""}]}', '{"data": [1]}', "nan"):
        with pytest.raises(ValueError):
            parse_model_list(bad)


async def _started_service(
    endpoints: str, models_interval: float, **overrides: object
) -> RouterService:
    """A started router service (no admin port, probes and scrapes off) reading the model
    lists of ``endpoints`` every ``models_interval`` seconds."""
    cfg = load_config(
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.admin_listen": "",
            "endpoints": endpoints,
            "health.enabled": False,
            "signals.enabled": False,
            "models.interval_seconds": models_interval,
            **overrides,
        },
        environ={},
    )
    svc = RouterService(cfg)
    await svc.start()
    return svc


async def _wait_for(condition, tries: int = 50) -> None:
    for _ in range(tries):
        if condition():
            return
        await asyncio.sleep(0.05)


async def test_the_lister_reads_real_model_lists_and_the_service_routes_by_them():
    """Stand-in replicas (the vLLM-shaped /v1/models) of two models behind one router
    service: once their lists are read, each model's requests reach only its replicas."""
    from extproc.fake_replica import ReplicaSettings, start_replica

    runners, addresses = [], {}
    for name, model in (("r1", "a"), ("r2", "a"), ("r3", "b")):
        runner, port = await start_replica(ReplicaSettings(name=name, model=model, port=0))
        runners.append(runner)
        addresses[f"127.0.0.1:{port}"] = model
    svc = await _started_service(",".join(addresses), 0.1)
    try:
        await _wait_for(lambda: all(svc.router.served_models().values()))
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


def test_an_empty_or_too_long_list_reads_as_any_model_even_after_a_good_one():
    from extproc.served_models import MAX_MODELS

    assert parse_model_list('{"data": []}') == frozenset()
    many = {"data": [{"id": f"lora-{i}"} for i in range(MAX_MODELS + 1)]}
    assert parse_model_list(orjson.dumps(many).decode()) == frozenset()
    cfg = load_config(None, {}, environ={})
    told: list[frozenset[str] | None] = []
    lister = ModelLister(cfg.models, lambda: A, lambda address, models: told.append(models))
    lister.record(A[0], frozenset({"base", "lora-1"}))
    lister.record(A[0], None)  # unreadable now: the last list stands
    lister.record(A[0], frozenset())  # too long now: any model
    assert told == [frozenset({"base", "lora-1"}), None]


async def test_a_new_endpoint_and_a_restarted_one_are_read_at_once():
    """Between rounds (every 10 s here) an endpoint not read yet is read within ~0.1 s: a
    just-discovered one, and one whose server restarted (its run-time adapters are gone)."""
    from extproc.fake_replica import ReplicaSettings, start_replica

    runner, port = await start_replica(ReplicaSettings(name="r", model="a", port=0))
    address = f"127.0.0.1:{port}"
    addresses: list[str] = []
    cfg = load_config(None, {"models.interval_seconds": 10.0}, environ={})
    told: list[tuple[str, frozenset[str] | None]] = []
    lister = ModelLister(cfg.models, lambda: list(addresses), lambda a, m: told.append((a, m)))
    lister.start()
    try:
        await asyncio.sleep(0.2)  # the first round: nothing to read
        addresses.append(address)
        await _wait_for(lambda: told, 40)
        assert told == [(address, frozenset({"a"}))]
        lister.unpolled(address)
        await _wait_for(lambda: len(told) == 2, 40)
        assert told[1:] == [(address, frozenset({"a"}))]
    finally:
        await lister.stop()
        await runner.cleanup()


async def test_lists_behind_an_api_key_are_read_with_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
):
    """vLLM's --api-key guards /v1/models: without the key the list reads as unreadable
    (any model may go there); with models.api_key_env naming a set variable it is read.
    Start-up refuses a name whose variable is not set, naming the field."""
    from extproc.fake_replica import ReplicaSettings, start_replica
    from extproc.served_models import auth_headers

    runner, port = await start_replica(
        ReplicaSettings(name="r", model="a", port=0, api_key="sekret")
    )
    address = f"127.0.0.1:{port}"

    async def read(overrides: dict) -> list[frozenset[str] | None]:
        cfg = load_config(None, {"models.interval_seconds": 10.0, **overrides}, environ={})
        told: list[frozenset[str] | None] = []
        lister = ModelLister(cfg.models, lambda: [address], lambda a, m: told.append(m))
        lister.start()
        try:
            await _wait_for(lambda: told, 40)
        finally:
            await lister.stop()
        return told

    try:
        assert await read({}) == [None]
        monkeypatch.setenv("VLLM_KEY_FOR_TEST", "sekret")
        assert await read({"models.api_key_env": "VLLM_KEY_FOR_TEST"}) == [frozenset({"a"})]
        cfg = load_config(None, {"models.api_key_env": "NOT_SET_ANYWHERE"}, environ={})
        with pytest.raises(ConfigError, match=r"models\.api_key_env"):
            auth_headers(cfg.models, environ={})
        with pytest.raises(ConfigError, match=r"models\.api_key_env"):
            load_config(None, {"models.api_key_env": "not a name"}, environ={})
    finally:
        await runner.cleanup()


def test_serve_refuses_to_start_without_the_named_key(capsys: pytest.CaptureFixture[str]):
    from extproc.cli import main

    code = main(
        ["serve", "--listen", "127.0.0.1:0", "--set", "models.api_key_env=NOT_SET_ANYWHERE_42"]
    )
    assert code == 2
    assert "models.api_key_env" in capsys.readouterr().err


def test_a_model_whose_servers_all_left_gets_no_endpoint_and_a_returning_one_its_list():
    """With discovery a not-ready pod leaves the endpoint set: its model then has no
    endpoint (the router's 503, which clients retry) for REMEMBER_SECONDS, not another
    model's servers (their 404); the pod back starts with its last list."""
    from extproc.model_pools import REMEMBER_SECONDS

    clock = [0.0]
    router = Router(
        RoutingConfig(), [EndpointConfig(address=a) for a in A + B], clock=lambda: clock[0]
    )
    for address in A:
        router.observe_models(address, frozenset({"a"}))
    router.observe_models(B[0], frozenset({"b"}))
    router.set_endpoints([EndpointConfig(address=a) for a in A])  # B not ready
    decision = router.route(chat("b", "where now? " * 30))
    assert decision.endpoint is None  # the 503, not pool a's 404
    router.set_endpoints([EndpointConfig(address=a) for a in A + B])  # back
    assert router.served_models()[B[0]] == frozenset({"b"})
    assert _placed(router, "b") == set(B)
    router.set_endpoints([EndpointConfig(address=a) for a in A])
    clock[0] = REMEMBER_SECONDS + 1  # long gone: a model no list names, one list left
    assert _placed(router, "b") == set(A)


async def _a_replica_and_a_hung_one():
    """A stand-in replica serving model "a" and a server whose model list never answers:
    (the replica's runner, its port, the hung server's runner, its address)."""
    from aiohttp import web

    from extproc.fake_replica import ReplicaSettings, start_replica

    runner, port = await start_replica(ReplicaSettings(name="r", model="a", port=0))
    hung_app = web.Application()

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    hung_app.router.add_get("/v1/models", hang)
    hung = web.AppRunner(hung_app, shutdown_timeout=0.1)
    await hung.setup()
    await web.TCPSite(hung, "127.0.0.1", 0).start()
    return runner, port, hung, f"127.0.0.1:{hung.addresses[0][1]}"


async def test_an_endpoint_read_again_during_a_round_held_up_by_a_hung_one_is_read_at_once():
    """A round waits for its slowest read (a hung endpoint: the timeout); an endpoint to
    read at once (just added, or its server restarted) is read meanwhile, not after it."""
    runner, port, hung, hung_address = await _a_replica_and_a_hung_one()
    address = f"127.0.0.1:{port}"
    cfg = load_config(
        None, {"models.interval_seconds": 10.0, "models.timeout_seconds": 3.0}, environ={}
    )
    told: list[tuple[str, float]] = []
    loop = asyncio.get_running_loop()
    lister = ModelLister(
        cfg.models, lambda: [address, hung_address], lambda a, m: told.append((a, loop.time()))
    )
    lister.start()
    try:
        await _wait_for(lambda: told, 40)
        assert [a for a, _ in told] == [address]  # the round still waits for the hung one
        asked = loop.time()
        lister.unpolled(address)
        await _wait_for(lambda: len(told) == 2, 40)
        assert told[1][0] == address and told[1][1] - asked < 0.5, told
    finally:
        await lister.stop()
        await runner.cleanup()
        await hung.cleanup()


async def test_a_hung_endpoint_read_at_once_holds_up_no_other_read_at_once():
    """Reads at once run each on their own: one of a hung endpoint (every list read again
    for an unknown model, or its server restarted) does not hold up another endpoint's
    until its timeout. (Told by order: the other's list comes before the hung one's
    timeouts.)"""
    runner, port, hung, hung_address = await _a_replica_and_a_hung_one()
    address = f"127.0.0.1:{port}"
    cfg = load_config(
        None, {"models.interval_seconds": 30.0, "models.timeout_seconds": 3.0}, environ={}
    )
    told: list[str] = []
    lister = ModelLister(cfg.models, lambda: [address, hung_address], lambda a, m: told.append(a))
    lister.start()
    try:
        await _wait_for(lambda: hung_address in told, 40)  # the first round (and reads at
        await asyncio.sleep(0.3)  # once of the endpoints new then) ended
        told.clear()
        lister.unpolled(hung_address)
        await asyncio.sleep(0.3)  # its read at once is under way, hung
        lister.unpolled(address)
        await _wait_for(lambda: hung_address in told, 40)
        assert told[0] == address, told
    finally:
        await lister.stop()
        await runner.cleanup()
        await hung.cleanup()


async def test_an_endpoint_discovery_brings_back_is_read_again_at_once():
    from extproc.fake_replica import ReplicaSettings, start_replica

    runner, port = await start_replica(ReplicaSettings(name="r", model="a", port=0))
    address = f"127.0.0.1:{port}"
    svc = await _started_service(address, 30.0)
    try:
        await _wait_for(lambda: svc.router.served_models()[address])
        reads = []
        svc.model_lister._on_models = lambda a, m: reads.append(a)
        svc._on_endpoints([])
        svc._on_endpoints([EndpointConfig(address=address)])  # within one check: not "new"
        await _wait_for(lambda: reads, 20)
        assert reads == [address]
    finally:
        await svc.stop(0)
        await runner.cleanup()


def test_a_model_no_list_names_has_every_list_read_again_at_once_within_limits(
    monkeypatch: pytest.MonkeyPatch,
):
    """An adapter loaded at run time is in no list until the next round: its first request
    asks for every list at once. Not more than once a second (the names asked meanwhile
    wait for the next check), and for one name (TGI's "tgi", a client's typo) once in
    UNKNOWN_MODEL_SECONDS, which holds up no other name."""
    from extproc import served_models

    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in A + B])
    for address in A + B:
        router.observe_models(address, frozenset({"base"}))
    router.route(chat("base", "known " * 30))
    assert router.models.take_unknown() == set()  # a model a list names
    cfg = load_config(None, {}, environ={})
    lister = ModelLister(cfg.models, lambda: A + B, lambda a, m: None, router.models.take_unknown)
    now = [1000.0]
    monkeypatch.setattr(served_models.time, "monotonic", lambda: now[0])
    router.route(chat("sql-lora", "new adapter " * 30))  # (any endpoint: one list)
    assert lister.wants_all()
    assert not lister.wants_all()  # (taken)
    now[0] += 0.5
    router.route(chat("other-lora", "another " * 30))
    assert not lister.wants_all()  # within a second of the last: it waits...
    now[0] += 0.6
    assert lister.wants_all()  # ... for the next check
    # A typo sent all the time does not starve a new adapter's read.
    for second in range(1, 31):
        now[0] += 1.0
        router.route(chat("gpt-4", "typo " * 30))
        if second == 25:
            router.route(chat("late-lora", "loaded at 25 s " * 30))
        read = lister.wants_all()
        assert read == (second in (1, 11, 21, 25)), second  # gpt-4 every 10 s; late-lora


def test_an_unreadable_list_of_a_member_not_ready_changes_nothing():
    """A pod restarting in place (not ready) answers no list while it loads: taken as "any
    model", it would join every pool the moment it is ready, until the next read."""
    endpoints = [EndpointConfig(address=a) for a in A + B]
    router = Router(RoutingConfig(), endpoints)
    router.observe_models(A[0], frozenset({"model-a"}))
    router.observe_models(A[1], frozenset({"model-a"}))
    router.observe_models(B[0], frozenset({"model-b"}))
    router.set_endpoints([e.model_copy(update={"ready": e.address != B[0]}) for e in endpoints])
    router.observe_models(B[0], None)
    assert router.served_models()[B[0]] == frozenset({"model-b"})
    router.set_endpoints(endpoints)
    assert _placed(router, "model-a") <= set(A)


async def _route_through(svc: RouterService, model: str, text: str, full_duplex: bool) -> dict:
    """One chat for ``model`` through the service's ext_proc stream (buffered, or full
    duplex ended by trailers): the router's record of it, with the endpoint its answer
    named (``"sent_to"``, "" when it passed it through)."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    from .test_server import body_msg, headers_msg

    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}]})
    messages = [headers_msg(full_duplex=full_duplex), body_msg(body, eos=not full_duplex)]
    if full_duplex:
        messages.append(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))

    async def stream():
        for message in messages:
            yield message

    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        answers = [a async for a in epg.ExternalProcessorStub(channel).Process(stream())]
    record = svc.decisions.recent(1)[0]
    sent_to = ""
    for answer in answers:
        common = (
            answer.request_body.response
            if answer.HasField("request_body")
            else answer.request_headers.response
        )
        for option in common.header_mutation.set_headers:
            if option.header.key == svc.config.server.header_name:
                sent_to = option.header.raw_value.decode().split(",")[0]
    return {**record, "sent_to": sent_to, "answers": len(answers)}


def _waits(result: str) -> float:
    """Requests counted as having waited for the lists read again, by how it ended."""
    from prometheus_client import REGISTRY

    name = "prefix_router_model_list_wait_seconds_count"
    return REGISTRY.get_sample_value(name, {"result": result}) or 0.0


async def _load_adapter(address: str, name: str) -> None:
    import aiohttp

    body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
    url = f"http://{address}/v1/load_lora_adapter"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as answer:
        assert answer.status == 200, await answer.text()


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full_duplex"])
async def test_the_first_request_for_an_adapter_loaded_at_run_time_goes_to_its_server(
    full_duplex: bool,
):
    """Two stand-in replicas list the same model, read once (the rounds an hour apart);
    then each loads adapters at run time. Each adapter's first request names a model no
    list read names: it waits for every list read again, and goes to the server that loaded
    it (before, it went by its prefix to either one, the other answering 404). Once
    listed, an adapter's requests do not wait."""
    from extproc.fake_replica import ReplicaSettings, start_replica

    runners, addresses = [], []
    for name in ("r1", "r2"):
        runner, port = await start_replica(ReplicaSettings(name=name, model="base", port=0))
        runners.append(runner)
        addresses.append(f"127.0.0.1:{port}")
    svc = await _started_service(",".join(addresses), 3600.0)
    listed_before = _waits("listed")
    try:
        await _wait_for(lambda: all(svc.router.served_models().values()))
        assert set(svc.router.served_models().values()) == {frozenset({"base"})}
        for k in range(6):
            if k:
                await asyncio.sleep(1.05)  # (another name had the lists read within 1 s)
            loader = addresses[k % 2]
            await _load_adapter(loader, f"lora-{k}")
            record = await _route_through(svc, f"lora-{k}", f"question {k} " * 40, full_duplex)
            assert record["sent_to"] == loader, (k, record)
            assert record["list_wait"] == "listed", record
            assert record["answers"] == (3 if full_duplex else 2), record  # (each message answered)
        again = await _route_through(svc, "lora-5", "question again " * 40, full_duplex)
        assert again["sent_to"] == addresses[1] and "list_wait" not in again, again
        assert _waits("listed") - listed_before == 6
    finally:
        await svc.stop(0)
        for runner in runners:
            await runner.cleanup()


async def test_a_request_waits_for_the_lists_no_longer_than_the_bound_and_a_typo_once():
    """A model no list names, read again while one endpoint's list hangs: the request
    waits ``models.unknown_wait_seconds`` and is routed; a name every list answered
    without is told at once ("not_listed") and, asked again within
    UNKNOWN_MODEL_SECONDS, does not wait; with the bound 0 nothing waits."""
    runner, port, hung, hung_address = await _a_replica_and_a_hung_one()
    address = f"127.0.0.1:{port}"
    svc = await _started_service(
        f"{address},{hung_address}",
        3600.0,
        **{"models.timeout_seconds": 3.0, "models.unknown_wait_seconds": 0.3},
    )
    try:
        await _wait_for(lambda: svc.router.served_models()[address])
        record = await _route_through(svc, "new-lora", "new " * 40, full_duplex=False)
        assert record["list_wait"] == "timeout" and record["outcome"] == "routed", record
        assert 250 <= record["list_wait_ms"] < 1000, record
    finally:
        await svc.stop(0)
        await hung.cleanup()
    svc = await _started_service(address, 3600.0)
    try:
        await _wait_for(lambda: svc.router.served_models()[address])
        typo = await _route_through(svc, "gpt-4", "typo " * 40, full_duplex=True)
        assert typo["list_wait"] == "not_listed" and typo["outcome"] == "routed", typo
        again = await _route_through(svc, "gpt-4", "typo again " * 40, full_duplex=True)
        assert "list_wait" not in again and again["outcome"] == "routed", again
    finally:
        await svc.stop(0)
    svc = await _started_service(address, 3600.0, **{"models.unknown_wait_seconds": 0})
    try:
        await _wait_for(lambda: svc.router.served_models()[address])
        record = await _route_through(svc, "other-lora", "other " * 40, full_duplex=False)
        assert "list_wait" not in record and record["outcome"] == "routed", record
    finally:
        await svc.stop(0)
        await runner.cleanup()


class _ScriptedLister(ModelLister):
    """Lists from a dict: each read of every list takes each one as it is when asked, and
    answers once its own gate (``gates[k]`` for the k-th read) is open: a read that asked
    before an adapter was loaded."""

    def __init__(self, lists: dict[str, set[str]], gates: list[asyncio.Event]) -> None:
        super().__init__(load_config(None, {}, environ={}).models, lambda: list(lists), _ignore)
        self.lists, self.gates, self.asked = lists, gates, 0

    async def poll(self, session, address):
        seen = frozenset(self.lists[address])
        gate = self.gates[self.asked // len(self.lists)]
        self.asked += 1
        await gate.wait()
        return seen


def _ignore(address: str, models: frozenset[str] | None) -> None:
    pass


async def test_a_name_that_joins_a_read_under_way_gets_one_more_read_and_a_recent_one_none(
    monkeypatch: pytest.MonkeyPatch,
):
    """A read of every list started for one adapter's request; a second adapter, loaded on
    B after that read asked B, has its request join the read: that read cannot list it,
    so one more read follows before its wait ends; a third, loaded while that one is under
    way, gets a third read. A name read within UNKNOWN_MODEL_SECONDS does not wait, even
    while another name's read is under way."""
    import aiohttp

    from extproc import served_models

    now = [1000.0]  # (the lister's clock only: the event loop's runs on)
    monkeypatch.setattr(served_models, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    gates = [asyncio.Event() for _ in range(4)]
    a, b = A[0], B[0]
    lister = _ScriptedLister({a: {"base"}, b: {"base"}}, gates)
    async with aiohttp.ClientSession() as session:
        lister.session = session
        first = lister.read_again_for("x-lora")
        await asyncio.sleep(0.01)  # (the read asked both lists: neither names y-lora)
        assert lister.asked == 2
        lister.lists[b].add("y-lora")
        joined = lister.read_again_for("y-lora")
        assert joined is not None and lister.read_again_for("y-lora") is joined
        gates[0].set()
        await asyncio.wait_for(first, 1)
        await asyncio.sleep(0.01)  # (the second read asked both lists)
        assert lister.asked == 4 and not joined.done()
        lister.lists[b].add("z-lora")
        late = lister.read_again_for("z-lora")
        gates[1].set()
        await asyncio.wait_for(joined, 1)  # (the second read)
        assert "y-lora" in lister.latest[b] and not late.done()
        gates[2].set()
        await asyncio.wait_for(late, 1)
        assert lister.asked == 6 and "z-lora" in lister.latest[b]  # (the third read)
        await asyncio.sleep(0.01)
        assert lister._reading is None  # (over)
        now[0] += 2.0
        third = lister.read_again_for("u-lora")  # (a read under way, for another name)
        assert third is not None and not third.done()
        assert lister.read_again_for("x-lora") is None  # read 2 s ago: no wait
        assert lister.read_again_for("y-lora") is None
        await lister.stop()
        assert third.done() and lister.read_again_for("w-lora") is None  # (stopping)


async def test_stopping_before_a_read_ran_lets_its_requests_go():
    """A read of the lists cancelled before its first step never runs its own clean-up:
    the lister's stop lets the waiting requests go and forgets the read."""
    import aiohttp

    lister = _ScriptedLister({A[0]: {"base"}}, [asyncio.Event()])
    async with aiohttp.ClientSession() as session:
        lister.session = session
        waiting = lister.read_again_for("x-lora")
        assert waiting is not None
        await lister.stop()
        assert waiting.done() and lister._reading is None and not lister._reading_for


def test_no_wait_where_no_list_is_read_or_the_name_is_known():
    """``unlisted``: only a model no list read names, while some endpoint's models come
    from its list, may have its request wait."""
    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in A + B])
    assert not router.models.unlisted("x-lora", 0.0)  # no list known yet
    for address in A + B:
        router.observe_models(address, frozenset({"base"}))
    assert router.models.unlisted("x-lora", 0.0)
    assert not router.models.unlisted("base", 0.0) and not router.models.unlisted("", 0.0)
    fixed = [EndpointConfig(address=a, models=("base",)) for a in A + B]
    assert not Router(RoutingConfig(), fixed).models.unlisted("x-lora", 0.0)
