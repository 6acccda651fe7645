"""A streamed response's headers come before its prefill, through a real Envoy.

vLLM and SGLang answer a ``"stream": true`` request with FastAPI's StreamingResponse, whose
headers go out as soon as the request is accepted; the fake replica does the same. The router
must therefore keep a stream's prefill charge past its response headers, or every streamed
request would count as no queued work at all.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

from extproc.stack import LOOPBACK, Stack

from .conftest import chat_body, start_routed_stack
from .test_observability import get


@pytest.mark.parametrize("body_mode", ["buffered", "full_duplex_streamed"])
def test_a_streamed_request_stays_charged_past_its_response_headers(tmp_path, body_mode):
    """In full-duplex mode Envoy even ends the processing stream at those headers."""
    with Stack(workdir=tmp_path) as stack:
        # 4 s: room to route the second request while the stream waits, on a slow machine.
        slow_prefill = ["--base-ttft-ms", "4000", "--decode-ms-per-token", "1"]
        members = stack.start_replicas(1, slow_prefill)
        # A slow drain keeps the charge for the whole test, whatever the machine's speed.
        routed = start_routed_stack(
            stack,
            "override-host",
            body_mode,
            members,
            ["--set", "routing.prefill_tokens_per_second=50", "--set", "health.enabled=false"],
        )
        admin = stack.router_admin_ports["router"]
        conn = http.client.HTTPConnection(LOOPBACK, routed.envoy_port, timeout=30)
        try:
            body = chat_body("stream this answer " * 40, stream=True)
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            stream = conn.getresponse()  # the headers: the prefill has not even started
            assert stream.status == 200
            assert stream.getheader("content-type", "").startswith("text/event-stream")
            # Envoy sent the headers to the router before the client saw them, so a request
            # decided now must find the stream's prefill still queued on the replica.
            assert routed.send(chat_body("a second conversation " * 20)).status == 200
            assert b"data: [DONE]" in stream.read()
            # Logged when each request ends; told apart by size (the stream's prompt is longer).
            url = f"http://{LOOPBACK}:{admin}/debug/decisions?limit=2&outcome=routed"
            deadline = time.monotonic() + 10  # the router hears of the end a moment later
            while len(entries := json.loads(get(url)[1])["decisions"]) < 2:
                assert time.monotonic() < deadline, entries
                time.sleep(0.05)
            entries = [d["decision"] for d in entries]
            later, streamed = sorted(entries, key=lambda d: d["prompt_tokens"])
            (candidate,) = later["candidates"]
            assert candidate["endpoint"] == members[0]
            assert candidate["queued_work"] > 0.5 * streamed["work"] > 0
        finally:
            conn.close()
