"""The SDK sends a sandbox's commands and files straight to its host's gateway, and through the API when it must.

What went where is read from both ends: the client's own count of the calls a
gateway answered (``routes.direct``) and the engine's count of the requests
its gateway served (``info()["gateway"]``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from forkyard import AsyncClient, Client, Sandbox
from forkyard._http import Route
from forkyard.errors import NotFound

pytestmark = pytest.mark.root


def served_by_the_gateway(stack: Any) -> int:
    with stack.engine.client() as engine:
        counters = engine.info()["gateway"]
    return int(counters["execs"] + counters["reads"] + counters["writes"])


def test_commands_and_files_go_straight_to_the_host(stack: Any, fy: Client, sb: Sandbox) -> None:
    before = served_by_the_gateway(stack)
    assert sb.exec("echo hi").stdout == "hi\n"
    sb.files.write("/tmp/direct.txt", b"straight there")
    assert sb.files.read("/tmp/direct.txt") == b"straight there"
    assert served_by_the_gateway(stack) - before == 3
    assert fy._sender.routes.direct == 3


def test_without_direct_everything_goes_through_the_api(stack: Any, sb: Sandbox) -> None:
    with Client(stack.url, stack.teams[0].key, direct=False) as through_api:
        sandbox = through_api.sandboxes.get(sb.id)
        before = served_by_the_gateway(stack)
        assert sandbox.exec("echo hi").stdout == "hi\n"
        sandbox.files.write("/tmp/api.txt", b"via the api")
        assert sandbox.files.read("/tmp/api.txt") == b"via the api"
        assert served_by_the_gateway(stack) == before
        assert through_api._sender.routes.direct == 0


def test_a_sandbox_known_by_its_id_only_is_looked_up_once(stack: Any, fy: Client, sb: Sandbox) -> None:
    with Client(stack.url, stack.teams[0].key) as fresh:
        sandbox = fresh.sandboxes.ref(sb.id)
        for _ in range(3):
            assert sandbox.exec(["true"]).exit_code == 0
        assert fresh._sender.routes.direct == 3


def test_an_unreachable_gateway_falls_back_to_the_api(stack: Any, fy: Client, sb: Sandbox) -> None:
    route = fy._sender.routes.routes[sb.id]
    fy._sender.routes.routes[sb.id] = Route("http://127.0.0.1:9", route.token, route.expires_at)  # nothing listens there
    before = served_by_the_gateway(stack)
    assert sb.exec("echo fine").stdout == "fine\n"
    assert served_by_the_gateway(stack) == before and fy._sender.routes.direct == 0, "it went through the API"
    assert fy._sender.routes.unreachable.get("http://127.0.0.1:9"), "and the gateway is left alone a while"


def test_a_refused_token_is_renewed(stack: Any, fy: Client, sb: Sandbox) -> None:
    route = fy._sender.routes.routes[sb.id]
    fy._sender.routes.routes[sb.id] = Route(route.url, route.token[:-4] + "AAAA", route.expires_at)  # not the host's
    assert sb.exec("echo renewed").stdout == "renewed\n"
    assert fy._sender.routes.routes[sb.id].token != route.token[:-4] + "AAAA"
    assert sb.exec("echo again").stdout == "again\n"
    assert fy._sender.routes.direct >= 1, "with the new token, straight to the host"


def test_an_error_from_the_gateway_is_the_apis_error(fy: Client, sb: Sandbox) -> None:
    with pytest.raises(NotFound) as raised:
        sb.files.read("/no/such/file")
    assert raised.value.code == "file_not_found"
    assert fy._sender.routes.direct == 0


def test_the_async_client_goes_straight_to_the_host_too(stack: Any, sb: Sandbox) -> None:
    async def run() -> int:
        async with AsyncClient(stack.url, stack.teams[0].key) as fy:
            sandbox = await fy.sandboxes.get(sb.id)
            results = await asyncio.gather(*(sandbox.exec(["echo", str(n)]) for n in range(8)))
            assert [result.stdout for result in results] == [f"{n}\n" for n in range(8)]
            await sandbox.files.write("/tmp/async.txt", b"async")
            assert await sandbox.files.read("/tmp/async.txt") == b"async"
            return fy._sender.routes.direct

    before = served_by_the_gateway(stack)
    assert asyncio.run(run()) == 10
    assert served_by_the_gateway(stack) - before == 10
