"""A web server in a sandbox, for the preview URL tests (tests/api/test_ports.py, tests/browser).

The base template is busybox: ``httpd`` serves /srv (a page, and a CGI script
whose answer streams: it writes a first line, then waits until the test makes
/tmp/go, then writes the last), and ``nc -ll -e`` runs a small websocket
server per connection (the handshake in shell, then a greeting, then a reply
saying how many bytes of the client's first frame it read).
"""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlsplit

import httpx

PAGE = "<!doctype html><title>sandbox page</title><p id=hello>hello from the sandbox</p>\n"
STREAM_CGI = """#!/bin/sh
printf 'Content-Type: text/plain\\r\\n\\r\\n'
echo first
while [ ! -e /tmp/go ]; do sleep 0.05; done
echo last
"""
WEBSOCKET_SH = r"""#!/bin/sh
key=""
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf '%s' "${line#*:}" | tr -d ' ') ;; esac
done
accept=$(printf '%s258EAFA5-E914-47DA-95CA-C5AB0DC85B11' "$key" | sha1sum | cut -d' ' -f1 | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n\r\n' "$accept"
printf '\201\005hello'
n=$(dd bs=1 count=10 2>/dev/null | wc -c)
printf '\201\006got %s' "$n"
printf '\210\002\003\350'
"""
HTTP_PORT = 8080
WEBSOCKET_PORT = 9001


def serve_in(api: httpx.Client, sandbox_id: str) -> None:
    """Write the site and start both servers as background processes; return once both listen."""
    made = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "mkdir -p /srv/cgi-bin"})
    assert made.status_code == 200 and made.json()["exit_code"] == 0, made.text
    files = {"/srv/index.html": PAGE, "/srv/cgi-bin/stream": STREAM_CGI, "/srv/ws.sh": WEBSOCKET_SH}
    for path, content in files.items():
        written = api.put(f"/api/v1/sandboxes/{sandbox_id}/files", params={"path": path}, content=content.encode())
        assert written.status_code in (200, 201), written.text
    made = api.post(f"/api/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "chmod 755 /srv/cgi-bin/stream /srv/ws.sh"})
    assert made.json()["exit_code"] == 0, made.text
    for command in (f"httpd -f -p {HTTP_PORT} -h /srv", f"nc -ll -p {WEBSOCKET_PORT} -e /srv/ws.sh"):
        started = api.post(f"/api/v1/sandboxes/{sandbox_id}/processes", json={"cmd": command})
        assert started.status_code == 201, started.text
    for port in (HTTP_PORT, WEBSOCKET_PORT):
        waited = api.post(f"/api/v1/sandboxes/{sandbox_id}/ports/{port}/wait", json={"timeout_s": 30})
        assert waited.status_code == 200 and waited.json()["listening"], waited.text


def via_loopback(url: str, stack_url: str) -> tuple[str, dict[str, str]]:
    """A preview URL as httpx reaches it: the web server at 127.0.0.1, its host name in the Host header."""
    parts = urlsplit(url)
    target = urlsplit(stack_url)
    return f"{target.scheme}://{target.netloc}{parts.path}{'?' + parts.query if parts.query else ''}", {"Host": parts.netloc}


def loopback_socket(stack_url: str) -> socket.socket:
    target = urlsplit(stack_url)
    return socket.create_connection((target.hostname or "127.0.0.1", target.port or 80))


def websocket_url(url: str, **_: Any) -> str:
    return "ws" + url[len("http") :]
