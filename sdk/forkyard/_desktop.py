"""``sandbox.desktop``: a desktop sandbox's screen and input, for computer-use agents (sync and async alike).

The helpers (``click``, ``type``, ...) each build one action and hand it to
``act``, which the sync and async classes define; so an agent's action maps to
one call, and ``act(*actions)`` sends several in one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

from . import _forward
from ._http import Settings
from .errors import ForkyardError

R = TypeVar("R")
Button = Literal["left", "middle", "right", "back", "forward"]
Point = tuple[int, int]
BROWSER_PORT = 9222  # the desktop environment's Chromium, DevTools protocol (environments/desktop.json)
BROWSER_WAIT_S = 60.0  # its service's own timeout_s: a fork does not wait for it


def _at(x: int | None, y: int | None) -> dict[str, int]:
    if (x is None) != (y is None):
        raise ValueError("give both x and y, or neither (then it happens where the cursor is)")
    return {} if x is None or y is None else {"x": x, "y": y}


class DesktopActions(Generic[R]):
    """The action helpers; ``act`` sends them (``R``: the answer, or an awaitable of it)."""

    def act(self, *actions: Mapping[str, Any]) -> R:
        raise NotImplementedError

    def move(self, x: int, y: int) -> R:
        return self.act({"type": "move", "x": x, "y": y})

    def click(self, x: int | None = None, y: int | None = None, *, button: Button = "left", count: int = 1) -> R:
        """Click (``count`` 2 or 3: double, triple) at x, y in screen pixels, or where the cursor is."""
        return self.act({"type": "click", **_at(x, y), "button": button, "count": count})

    def double_click(self, x: int | None = None, y: int | None = None, *, button: Button = "left") -> R:
        return self.act({"type": "double_click", **_at(x, y), "button": button})

    def triple_click(self, x: int | None = None, y: int | None = None, *, button: Button = "left") -> R:
        return self.act({"type": "triple_click", **_at(x, y), "button": button})

    def mouse_down(self, x: int | None = None, y: int | None = None, *, button: Button = "left") -> R:
        return self.act({"type": "mouse_down", **_at(x, y), "button": button})

    def mouse_up(self, x: int | None = None, y: int | None = None, *, button: Button = "left") -> R:
        return self.act({"type": "mouse_up", **_at(x, y), "button": button})

    def drag(self, path: Sequence[Point], *, button: Button = "left") -> R:
        """Press at the first point, move through the others, release at the last."""
        return self.act({"type": "drag", "path": [{"x": x, "y": y} for x, y in path], "button": button})

    def scroll(self, x: int | None = None, y: int | None = None, *, dx: int = 0, dy: int = 0) -> R:
        """Wheel steps: positive ``dy`` scrolls down, positive ``dx`` right."""
        return self.act({"type": "scroll", **_at(x, y), "dx": dx, "dy": dy})

    def key(self, keys: str | Sequence[str], *, repeat: int = 1) -> R:
        """Press keys together: ``"ctrl+c"``, ``["ctrl", "shift", "t"]``, ``"enter"``, ``"F5"``."""
        return self.act({"type": "key", "keys": keys if isinstance(keys, str) else list(keys), "repeat": repeat})

    def hold_key(self, keys: str | Sequence[str], seconds: float) -> R:
        return self.act({"type": "hold_key", "keys": keys if isinstance(keys, str) else list(keys), "seconds": seconds})

    def type(self, text: str) -> R:
        """Type text as a keyboard would (a newline is Enter)."""
        return self.act({"type": "type", "text": text})

    def wait(self, seconds: float) -> R:
        return self.act({"type": "wait", "seconds": seconds})


def screenshot_body(
    scale: float | None, max_width: int | None, max_height: int | None, image_format: str, quality: int | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"format": image_format}
    for name, value in (("scale", scale), ("max_width", max_width), ("max_height", max_height), ("quality", quality)):
        if value is not None:
            body[name] = value
    return body


@contextlib.contextmanager
def forwarded(settings: Settings, sandbox_id: str, port: int) -> Iterator[str]:
    """``http://127.0.0.1:<local port>`` relayed to ``port`` in the sandbox while the block runs (a thread
    with its own event loop; ``_forward``)."""
    loop = asyncio.new_event_loop()
    ready: list[int] = []
    started = threading.Event()
    failure: list[BaseException] = []

    def on_ready(local: int) -> None:
        ready.append(local)
        started.set()

    task = loop.create_task(_forward.forward(settings.url, settings.api_key, sandbox_id, port, 0, on_ready))

    def serve() -> None:
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            failure.append(error)
        finally:
            started.set()
            # The connections still relaying (the server's own tasks) end here, not as destroyed tasks.
            pending = asyncio.all_tasks(loop)
            for relay in pending:
                relay.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())

    thread = threading.Thread(target=serve, name=f"forkyard-forward-{port}", daemon=True)
    thread.start()
    started.wait(30)
    try:
        if failure:
            raise failure[0]
        if not ready:
            raise ForkyardError("forward_failed", f"could not relay port {port} of {sandbox_id}")
        yield f"http://127.0.0.1:{ready[0]}"
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        if not thread.is_alive():
            loop.close()


@contextlib.asynccontextmanager
async def async_forwarded(settings: Settings, sandbox_id: str, port: int) -> AsyncIterator[str]:
    """The same, as a task of the caller's event loop."""
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def on_ready(local: int) -> None:
        if not ready.done():
            ready.set_result(local)

    task = asyncio.ensure_future(_forward.forward(settings.url, settings.api_key, sandbox_id, port, 0, on_ready))
    try:
        done, _ = await asyncio.wait((task, ready), timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the forward's refusal
        if not ready.done():
            raise ForkyardError("forward_failed", f"could not relay port {port} of {sandbox_id}")
        yield f"http://127.0.0.1:{ready.result()}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
