"""Request bodies: refused before they are read, bounded per endpoint, uploads streamed (never held whole).

What is asserted is what the system reports: the status the server answers
while the client is still sending, and the web server's peak resident memory
(``VmHWM`` in /proc) before and after.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.root
MIB = 1024 * 1024


def peak_kib(pid: int) -> int:
    """The process's high-water mark of resident memory, as the kernel counts it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def raw_request(port: int, head: str, body_chunks: int, chunk: bytes = b"x" * MIB) -> tuple[bytes, int]:
    """Send a request's head, then up to ``body_chunks`` MiB of body, stopping at the first answer; (answer, MiB sent)."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    connection.sendall(head.encode())
    connection.setblocking(False)
    sent, answer = 0, b""
    try:
        while sent < body_chunks:
            try:
                answer += connection.recv(65536)
            except BlockingIOError:
                pass
            if answer:
                break
            try:
                connection.sendall(chunk)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                time.sleep(0.01)
                continue
            sent += 1
        connection.setblocking(True)
        connection.settimeout(10)
        while True:  # a refusal closes the connection once it is answered
            try:
                more = connection.recv(65536)
            except ConnectionResetError:
                break
            if not more:
                break
            answer += more
    finally:
        connection.close()
    return answer, sent


def test_an_upload_without_a_key_is_refused_before_its_body_is_read(stack) -> None:
    before = peak_kib(stack.web_pid)
    head = (
        "PUT /api/v1/sandboxes/sb_0000000000000000/files?path=/big HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nContent-Length: {1024 * MIB}\r\n\r\n"
    )
    answer, sent = raw_request(stack.port, head, body_chunks=256)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b'"code": "unauthorized"' in answer
    assert sent < 256, "the server answered only once the client had sent everything"
    assert peak_kib(stack.web_pid) - before < 64 * 1024, "the web server held the body"


def test_a_body_over_its_endpoints_limit_is_413_before_it_is_read(stack) -> None:
    key = stack.teams[0].key
    head = (
        "POST /api/v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {64 * MIB}\r\n\r\n"
    )
    answer, sent = raw_request(stack.port, head, body_chunks=64)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "too_large" and body["error"]["details"] == {"limit": MIB}
    assert sent < 64


def test_a_chunked_body_is_counted_as_it_arrives(api: httpx.Client) -> None:
    def chunks():
        for _ in range(3):
            yield b" " * MIB  # JSON whitespace: only its size is wrong

    answer = api.post("/api/v1/sandboxes", content=chunks(), headers={"Content-Type": "application/json"})
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"] == {
        "code": "too_large",
        "message": "the request body is over this endpoint's limit of 1048576 bytes",
        "details": {"limit": MIB},
    }


def test_an_upload_is_streamed_to_the_sandbox_not_held(stack, api: httpx.Client) -> None:
    created = api.post("/api/v1/sandboxes", json={"template": "base", "size": "default", "ttl_s": 300})
    assert created.status_code == 201, created.text
    sandbox = created.json()
    try:
        before = peak_kib(stack.web_pid)
        size = 256 * MIB

        def content():
            for _ in range(size // MIB):
                yield b"\xab" * MIB

        written = api.put(f"/api/v1/sandboxes/{sandbox['id']}/files", params={"path": "/tmp/big"}, content=content())
        assert written.status_code == 200, written.text
        assert written.json()["bytes"] == size
        grown = peak_kib(stack.web_pid) - before
        assert grown < 64 * 1024, f"the web server's peak grew by {grown} KiB for a {size // MIB} MiB upload"
        stat = api.post(f"/api/v1/sandboxes/{sandbox['id']}/exec", json={"cmd": ["stat", "-c", "%s", "/tmp/big"]}).json()
        assert stat["stdout"].strip() == str(size)
    finally:
        api.delete(f"/api/v1/sandboxes/{sandbox['id']}")


def test_text_that_is_not_unicode_is_refused_where_it_is(api: httpx.Client) -> None:
    body = b'{"template": "base", "size": "tiny", "labels": {"ok": "fine", "bad": "\\ud800"}}'
    answer = api.post("/api/v1/sandboxes", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "invalid_text" and answer.json()["error"]["field"] == "labels.bad"
    keyed = b'{"name": "p", "egress": [], "description": "\\udfff"}'
    answer = api.post("/api/v1/network-policies", content=keyed, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "description"
