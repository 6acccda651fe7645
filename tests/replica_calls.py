"""Calling a model server's own HTTP API from tests (shared by the test packages)."""

from __future__ import annotations

import json
import urllib.request


def post(address: str, path: str, body: dict | None = None, timeout: float = 60) -> int:
    """POST to the server (``body`` as JSON, else empty); its status (errors raise)."""
    data = b"" if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    request = urllib.request.Request(f"http://{address}{path}", data, headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status
