"""Resources whose calls are one request and one answer, written once for both clients.

An ``Endpoint`` pairs a request builder from ``_calls`` with a parser.  Read
from a resource bound to a ``Sender`` it is a plain method; bound to an
``AsyncSender`` it is a coroutine method: the same signature (the builder's),
the same docstring, the same request.  Sandboxes, launches and snapshots, whose
methods poll, stream and hand out live objects, are written out in ``client`` and
``aio``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

from . import _calls as calls
from ._http import AsyncSender, Call, RateLimit, Sender
from ._pages import Page
from ._templates import BuildFollower, TemplateSpec, raise_if_build_failed
from .errors import Unavailable
from .models import ApiKey, CreatedKey, Lease, NetworkPolicy, Template, TemplateBuild, Usage, WhoAmI

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S", bound=Sender | AsyncSender)


class Resource(Generic[S]):
    """Something that calls the API through a sync or an async sender."""

    def __init__(self, sender: S) -> None:
        self._sender: S = sender


class Endpoint(Generic[P, T]):
    """A method made of a request builder (its signature and docstring) and a parser of the answer."""

    def __init__(self, build: Callable[P, Call], parse: Callable[[Any], T]) -> None:
        self.build, self.parse = build, parse
        self.__doc__ = build.__doc__
        self.name = build.__name__
        # help() and IDEs show the builder's parameters, without its ``-> Call``.
        self.signature = inspect.signature(build).replace(return_annotation=inspect.Signature.empty)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _describe(self, method: Callable[..., Any]) -> Any:
        method.__name__ = method.__qualname__ = self.name
        method.__doc__ = self.__doc__
        method.__signature__ = self.signature  # type: ignore[attr-defined]
        return method

    @overload
    def __get__(self, instance: None, owner: type) -> Endpoint[P, T]: ...

    @overload
    def __get__(self, instance: Resource[Sender], owner: type) -> Callable[P, T]: ...

    @overload
    def __get__(self, instance: Resource[AsyncSender], owner: type) -> Callable[P, Awaitable[T]]: ...

    def __get__(self, instance: Resource[Any] | None, owner: type) -> Any:
        if instance is None:
            return self
        sender = instance._sender
        if isinstance(sender, AsyncSender):
            async_sender = sender

            async def call_async(*args: P.args, **kwargs: P.kwargs) -> T:
                return self.parse(await async_sender.json(self.build(*args, **kwargs)))

            return self._describe(call_async)

        def call(*args: P.args, **kwargs: P.kwargs) -> T:
            return self.parse(sender.json(self.build(*args, **kwargs)))

        return self._describe(call)


def _page(name: str, parse: Callable[[Any], T]) -> Callable[[Any], Page[T]]:
    """A list's answer: its items under their plural name, and the cursor of the next page."""
    return lambda data: Page([parse(row) for row in data[name]], data.get("next_cursor"))


def _nothing(_: Any) -> None:
    return None


class Templates(Resource[S]):
    """``fy.templates``: the root filesystems sandboxes start from, and the team's own builds of them."""

    list = Endpoint(calls.list_templates, _page("templates", Template.from_api))
    get = Endpoint(calls.get_template, Template.from_api)
    delete = Endpoint(calls.delete_template, _nothing)
    start_build = Endpoint(calls.start_template_build, TemplateBuild.from_api)
    last_build = Endpoint(calls.get_template_build, TemplateBuild.from_api)

    @overload
    def build(
        self: Templates[Sender],
        name: str,
        spec: TemplateSpec,
        *,
        description: str = "",
        timeout_s: float | None = None,
        on_log: Callable[[str], None] | None = None,
        on_progress: Callable[[TemplateBuild], None] | None = None,
    ) -> Template: ...

    @overload
    def build(
        self: Templates[AsyncSender],
        name: str,
        spec: TemplateSpec,
        *,
        description: str = "",
        timeout_s: float | None = None,
        on_log: Callable[[str], None] | None = None,
        on_progress: Callable[[TemplateBuild], None] | None = None,
    ) -> Awaitable[Template]: ...

    def build(
        self,
        name: str,
        spec: TemplateSpec,
        *,
        description: str = "",
        timeout_s: float | None = None,
        on_log: Callable[[str], None] | None = None,
        on_progress: Callable[[TemplateBuild], None] | None = None,
    ) -> Template | Awaitable[Template]:
        """Build the team's template ``name`` from ``spec`` and wait for it: its output goes to ``on_log`` as
        it comes, each move of its steps to ``on_progress``; the template, once ready. A failed build raises
        ``TemplateBuildFailed`` (its ``output``: the failed step's). Steps an earlier build of the team
        already ran the same way are reused, so a rebuild of the same spec is ready at once."""
        body = spec.to_api(name, description=description, timeout_s=timeout_s)
        follower = BuildFollower(on_log, on_progress)
        sender = self._sender
        if isinstance(sender, AsyncSender):
            return self._build_async(sender, name, body, follower)
        sender.json(calls.start_template_build(body))
        while follower.ended is None:
            try:
                with sender.stream(calls.follow_template_build(name)) as response:
                    for line in response.iter_lines():
                        if follower.feed(line):
                            break
            except Unavailable:
                continue  # cut off: the stream starts over (its log from what the server still keeps)
        raise_if_build_failed(follower.ended)
        return Template.from_api(sender.json(calls.get_template(name)))

    @staticmethod
    async def _build_async(sender: AsyncSender, name: str, body: dict[str, Any], follower: BuildFollower) -> Template:
        await sender.json(calls.start_template_build(body))
        while follower.ended is None:
            try:
                async with sender.stream(calls.follow_template_build(name)) as response:
                    async for line in response.aiter_lines():
                        if follower.feed(line):
                            break
            except Unavailable:
                continue
        raise_if_build_failed(follower.ended)
        return Template.from_api(await sender.json(calls.get_template(name)))


class NetworkPolicies(Resource[S]):
    """``fy.network_policies``: where sandboxes may connect (egress rules)."""

    list = Endpoint(calls.list_policies, _page("network_policies", NetworkPolicy.from_api))
    create = Endpoint(calls.create_policy, NetworkPolicy.from_api)
    get = Endpoint(calls.get_policy, NetworkPolicy.from_api)
    update = Endpoint(calls.update_policy, NetworkPolicy.from_api)
    delete = Endpoint(calls.delete_policy, _nothing)


class Keys(Resource[S]):
    """``fy.keys``: the team's API keys (creating and revoking needs an admin key)."""

    list = Endpoint(calls.list_keys, _page("keys", ApiKey.from_api))
    create = Endpoint(calls.create_key, CreatedKey.from_api)
    revoke = Endpoint(calls.revoke_key, ApiKey.from_api)


class Leases(Resource[S]):
    """``fy.leases``: leases taken by hand (``Client(lease=True)`` takes and keeps one itself)."""

    create = Endpoint(calls.create_lease, Lease.from_api)
    get = Endpoint(calls.get_lease, Lease.from_api)
    list = Endpoint(calls.list_leases, _page("leases", Lease.from_api))
    heartbeat = Endpoint(calls.heartbeat_lease, Lease.from_api)
    end = Endpoint(calls.end_lease, Lease.from_api)


class ClientBase(Resource[S]):
    """What ``Client`` and ``AsyncClient`` share: the one-request resources, who am I, usage."""

    me = Endpoint(calls.me, WhoAmI.from_api)
    usage = Endpoint(calls.usage, Usage.from_api)

    def __init__(self, sender: S) -> None:
        super().__init__(sender)
        self.templates: Templates[S] = Templates(sender)
        self.network_policies: NetworkPolicies[S] = NetworkPolicies(sender)
        self.keys: Keys[S] = Keys(sender)
        self.leases: Leases[S] = Leases(sender)

    @property
    def url(self) -> str:
        return self._sender.settings.url

    @property
    def rate_limit(self) -> RateLimit | None:
        """The team's request-rate limit as the last response reported it."""
        return self._sender.rate_limit
