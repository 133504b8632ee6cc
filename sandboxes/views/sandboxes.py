"""Sandboxes in the console: the list, one sandbox, its command box, and its buttons."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypedDict
from urllib.parse import quote

from django import forms
from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST
from django.views.decorators.vary import vary_on_headers

from billing.charts import sandbox_spend
from billing.selectors import stop_of
from console.access import HtmxRequest, team_view
from console.errors import Refused
from console.models import Membership
from console.permissions import Action
from console.selectors import limits_of
from sandboxes.engine.client import ExecOutput
from sandboxes.engine.errors import EngineError

from .. import engine_link, selectors, sizes
from ..api.desktop import VIEW_PORTS, live_view_for
from ..forms import ExecForm, NewSandboxForm, SandboxFilterForm, ServiceFormSet, SnapshotForm, TerminalForm
from ..models import Sandbox
from ..services.sandboxes import sandbox_create, sandbox_destroy, sandbox_pause
from ..services.snapshots import snapshot_create

PAGE_SIZE = 50
OUTPUT_CAP = 256 * 1024  # per stream: a page, not a download
DOWNLOAD_CAP = 16 * 1024 * 1024  # a file from the page's browser; larger ones through the API
VIEW_TTL_S = 3600  # the console's live view link: an hour, as the API's by default


@vary_on_headers("HX-Request")
@team_view()
def sandbox_list(request: HtmxRequest, membership: Membership) -> HttpResponse:
    """Live sandboxes unless another state (or any) is asked; ``q`` finds one by its id (or the start of it)."""
    form = SandboxFilterForm(request.GET)
    form.is_valid()  # a field that does not validate shows its error and filters nothing
    chosen = form.cleaned_data.get("state") or ""
    state = chosen if chosen not in ("", "all") else None
    label = form.cleaned_data.get("label") or None
    cursor = form.cleaned_data.get("cursor") or None
    query = form.cleaned_data.get("q") or None
    if query and not cursor:
        exact = Sandbox.objects.filter(team=membership.team, pk=query).only("pk").first()
        if exact is not None and not request.htmx:
            return redirect("console:sandbox", sandbox_id=exact.pk)
    page = selectors.sandboxes_page(
        membership.team, state=state, label=label, cursor=cursor, limit=PAGE_SIZE, strict=False,
        live_only=chosen == "", search=query,
    )
    counts = selectors.state_counts(membership.team, label)
    live = sum(counts.get(value, 0) for value in Sandbox.LIVE)
    context = {
        "form": form,
        "sandboxes": page.rows,
        "next_cursor": page.next_cursor,
        "paged": bool(cursor),
        "counts": [(value, name, counts.get(value, 0)) for value, name in Sandbox.State.choices],
        "total": sum(counts.values()),
        "live": live,
        "ended": sum(counts.values()) - live,
        "chosen": chosen,
        "matching": counts.get(state, 0) if state else (live if chosen == "" else sum(counts.values())),
        "query": query,
        "can_run": membership.can("member"),
    }
    template = "sandboxes/_sandbox_table.html" if request.htmx else "sandboxes/sandbox_list.html"
    return render(request, template, context)


def _new_form_options(membership: Membership) -> dict[str, Any]:
    team = membership.team
    return {
        "templates": [template.name for template in selectors.templates_page(team, cursor=None, limit=200, strict=False).rows],
        "sizes": sorted(sizes.catalogue()),
        "policies": [(policy.pk, policy.name) for policy in selectors.policies_page(team, cursor=None, limit=200, strict=False).rows],
        "max_ttl_s": limits_of(team).max_ttl_s,
    }


@team_view(Action.RUN_SANDBOXES)
def sandbox_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    form = NewSandboxForm(request.POST if request.method == "POST" else None, **_new_form_options(membership))
    if form.is_valid():
        try:
            sandbox, _ = sandbox_create(team=membership.team, key=None, spec=form.spec())
        except (Refused, forms.ValidationError) as error:
            form.add_error(getattr(error, "field", None) if getattr(error, "field", None) in form.fields else None, getattr(error, "message", str(error)))
        else:
            messages.success(request, f"{sandbox.id} is {sandbox.state}: it starts on {sandbox.host.name if sandbox.host else 'its host'}.")
            return redirect("console:sandbox", sandbox_id=sandbox.id)
    return render(request, "sandboxes/sandbox_new.html", {"form": form})


def _metrics(sandbox: Sandbox) -> dict[str, Any] | None:
    """What the kernel reports about it now (the API's ``GET .../metrics``), for a running or paused sandbox
    whose host is live; None otherwise, or if its host does not answer (the page shows the rest)."""
    host = sandbox.host
    if (
        not sandbox.reachable
        or host is None
        or host.last_heartbeat < timezone.now() - timedelta(seconds=settings.FORKYARD_HOST_STALE_S)
    ):
        return None
    try:
        stats: dict[str, Any] = engine_link.engine(host.engine_socket).call("stats", id=sandbox.engine_id)
    except EngineError:
        return None
    stats["cpu_percent"] = round(100 * stats.get("cpu_share", 0.0), 1)
    return stats


def _detail(request: HttpRequest, sandbox: Sandbox, status: int = 200, **extra: Any) -> HttpResponse:
    seconds, spent = sandbox_spend(sandbox)
    context = {
        "sandbox": sandbox,
        "metrics": _metrics(sandbox),
        "budget_stop": stop_of(sandbox.pk),
        "terminal_socket": settings.FORKYARD_WEBSOCKET_URL,
        "socket_port": settings.FORKYARD_WEBSOCKET_PORT,
        "ended_by": sandbox.error_code in Sandbox.END_REASONS,
        "exec_form": ExecForm(),
        "snapshot_form": SnapshotForm(),
        "service_forms": ServiceFormSet(prefix="services"),
        "billed_seconds": seconds,
        "spent": spent,
        **extra,
    }
    return render(request, "sandboxes/sandbox_detail.html", context, status=status)


@team_view()
def sandbox_detail(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    return _detail(request, selectors.sandbox_for(membership.team, sandbox_id))


@never_cache
@team_view()
def sandbox_metrics(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    """The metrics panel alone, read from the engine now: the page polls it every few seconds."""
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    seconds, spent = sandbox_spend(sandbox)
    context = {"sandbox": sandbox, "metrics": _metrics(sandbox), "billed_seconds": seconds, "spent": spent}
    return render(request, "sandboxes/_sandbox_metrics.html", context)


@never_cache  # a listing of the sandbox's files is the caller's alone, and not kept
@vary_on_headers("HX-Request")
@team_view()
def sandbox_files(request: HtmxRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    """One directory of the sandbox, for the page's file browser (the engine's ``files.list``)."""
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    path = _clean_path(request.GET.get("path") or "/")
    listing: dict[str, Any] | None = None
    error = None
    try:
        selectors.require_started(sandbox, "show its files")
        assert sandbox.host is not None  # a started sandbox has a host
        listing = engine_link.engine(sandbox.host.engine_socket).list_files(sandbox.engine_id, path)
    except Refused as refused:
        error = refused.message
    except EngineError as engine_error:
        error = engine_link.refusal(engine_error, sandbox).message
    entries = sorted((listing or {}).get("entries", []), key=lambda entry: (entry["type"] != "directory", entry["name"]))
    parent = path.rstrip("/").rsplit("/", 1)[0] or "/"
    context = {
        "sandbox": sandbox,
        "path": path,
        "parent": parent if path != "/" else None,
        "entries": [{**entry, "path": f"{path.rstrip('/')}/{entry['name']}"} for entry in entries],
        "truncated": bool((listing or {}).get("truncated")),
        "files_error": error,
    }
    template = "sandboxes/_files.html" if request.htmx else "sandboxes/sandbox_files.html"
    return render(request, template, context)


@never_cache
@team_view(Action.SEE_SANDBOXES)
def sandbox_file_download(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    """One file of the sandbox, as a download (up to ``DOWNLOAD_CAP``: a page, not a bulk copy: use the API)."""
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    path = _clean_path(request.GET.get("path") or "")
    try:
        selectors.require_started(sandbox, "hand out its files")
        assert sandbox.host is not None
        client = engine_link.engine(sandbox.host.engine_socket)
        size = int(client.call("files.stat", id=sandbox.engine_id, path=path).get("size", 0))
        if size > DOWNLOAD_CAP:
            return HttpResponse(f"{path} is {size:,} bytes: download files over {DOWNLOAD_CAP:,} bytes through the API", status=413, content_type="text/plain; charset=utf-8")
        data = client.read_file(sandbox.engine_id, path)
    except Refused as refused:
        return HttpResponse(refused.message, status=409, content_type="text/plain; charset=utf-8")
    except EngineError as engine_error:
        return HttpResponse(engine_link.refusal(engine_error, sandbox).message, status=404, content_type="text/plain; charset=utf-8")
    response = HttpResponse(data, content_type="application/octet-stream")
    name = path.rsplit("/", 1)[-1] or "file"
    response["Content-Disposition"] = f"attachment; filename*=UTF-8''{quote(name)}"
    return response


def _clean_path(path: str) -> str:
    """An absolute path inside the sandbox (the engine resolves it inside the sandbox's root, whatever it says)."""
    path = "/" + path.strip().lstrip("/")
    return path[:4096]


@never_cache
@require_POST
@team_view(Action.RUN_SANDBOXES)
def sandbox_terminal(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    """Start a shell on a terminal in the sandbox (the API's pty process); the page attaches to it over the
    console's websocket (``sandboxes/board/terminal.py``) and types into it."""
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    form = TerminalForm(request.POST)
    rows, cols = (form.cleaned_data["rows"], form.cleaned_data["cols"]) if form.is_valid() else (24, 80)
    try:
        selectors.require_started(sandbox, "open a terminal")
        assert sandbox.host is not None
        started = engine_link.engine(sandbox.host.engine_socket).call(
            "processes.start", id=sandbox.engine_id, cmd=["/bin/sh", "-l"], env={"TERM": "xterm-256color"}, pty={"rows": rows, "cols": cols}
        )
    except Refused as refused:
        return JsonResponse({"error": {"code": refused.code, "message": refused.message}}, status=409)
    except EngineError as engine_error:
        refusal = engine_link.refusal(engine_error, sandbox)
        return JsonResponse({"error": {"code": refusal.code, "message": refusal.message}}, status=409)
    return JsonResponse({"pid": started["pid"], "socket": f"/ws/terminal/{sandbox.pk}/{started['pid']}/"})


class ExecOutcome(TypedDict):
    """What a command run from the console shows: on the whole page, or as its htmx fragment."""

    exec_form: ExecForm
    result: ExecOutput | None
    exec_error: str | None


def _run(sandbox: Sandbox, cmd: str, timeout_s: float) -> tuple[ExecOutput | None, str | None]:
    """(output, None) or (None, a sentence for the page); the API's exec, run from a view."""
    try:
        selectors.require_started(sandbox)
    except Refused:
        return None, f"This sandbox is {sandbox.state}: commands run only while it runs."
    assert sandbox.host is not None  # a started sandbox has a host
    try:
        client = engine_link.engine(sandbox.host.engine_socket)
        return client.exec(sandbox.engine_id, cmd, timeout_s=timeout_s, max_output_bytes=OUTPUT_CAP), None
    except EngineError as error:
        return None, engine_link.refusal(error, sandbox).message


def _desktop(sandbox: Sandbox) -> dict[str, Any] | None:
    """The sandbox's screen and cursor (the engine's ``desktop.info``) if an X desktop runs in it (one
    made from the desktop environment); None otherwise. No process runs for it without a screen."""
    if not sandbox.reachable or sandbox.host is None:
        return None
    try:
        info: dict[str, Any] = engine_link.engine(sandbox.host.engine_socket).call("desktop.info", id=sandbox.engine_id)
    except EngineError:
        return None
    return info


@never_cache
@team_view()
def sandbox_desktop(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    """The page's desktop panel, loaded after the page: empty unless a desktop runs in the sandbox."""
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    context = {
        "sandbox": sandbox,
        "desktop": _desktop(sandbox),
        "socket": settings.FORKYARD_WEBSOCKET_URL,  # the live view's (views/live_view.py), as the terminal's
        "socket_port": settings.FORKYARD_WEBSOCKET_PORT,
    }
    return render(request, "sandboxes/_desktop.html", context)


@never_cache  # the signed URL is the caller's alone
@require_POST
@team_view(Action.RUN_SANDBOXES)
def sandbox_desktop_view(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    """The live view in a tab of its own (the API's ``POST .../desktop/view``): a page that sends the tab
    the panel's form opens on to noVNC's signed page on the preview host (a redirect would break the
    console's ``form-action 'self'``): a link that can be shared. The panel's own view, on the page,
    is the console's (``views/live_view.py``)."""
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    mode = request.POST.get("mode", "view")
    if mode not in VIEW_PORTS:
        return HttpResponse(f"mode is one of {', '.join(VIEW_PORTS)}", status=400, content_type="text/plain; charset=utf-8")
    if _desktop(sandbox) is None:
        return HttpResponse(
            f"No desktop runs in {sandbox.id} now (it is {sandbox.state}).", status=409, content_type="text/plain; charset=utf-8"
        )
    try:
        view = live_view_for(membership.team, sandbox, mode, VIEW_TTL_S, request.META.get("HTTP_HOST", ""))
    except Refused as refused:
        return HttpResponse(refused.message, status=409, content_type="text/plain; charset=utf-8")
    return render(request, "sandboxes/desktop_view.html", {"sandbox": sandbox, "view": view})


@never_cache  # the output is the caller's alone, and is not kept anywhere
@vary_on_headers("HX-Request")
@require_POST
@team_view(Action.RUN_SANDBOXES)
def sandbox_exec(request: HtmxRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    form = ExecForm(request.POST)
    result, error = None, None
    if form.is_valid():
        result, error = _run(sandbox, form.cleaned_data["cmd"], form.cleaned_data["timeout_s"])
    outcome: ExecOutcome = {"exec_form": form, "result": result, "exec_error": error}
    if request.htmx and not form.is_valid():  # the form again, its errors at their fields
        response = render(request, "sandboxes/_exec_form.html", {"sandbox": sandbox, **outcome})
        response["HX-Retarget"], response["HX-Reswap"] = "#exec-form", "outerHTML"
        return response
    if request.htmx:  # one more entry of the page's own history (newest first), and the form as it was; nothing is kept
        context = {"sandbox": sandbox, "cmd": form.cleaned_data["cmd"], "ran_at": timezone.now(), "oob": True, **outcome}
        return HttpResponse(
            render_to_string("sandboxes/_exec_result.html", context, request)
            + render_to_string("sandboxes/_exec_form.html", context, request)
        )
    return _detail(request, sandbox, cmd=form.data.get("cmd", ""), ran_at=timezone.now(), **outcome)


@require_POST
@team_view(Action.RUN_SANDBOXES)
def sandbox_kill(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    if sandbox.live:
        sandbox = sandbox_destroy(sandbox=sandbox)
        if sandbox.state == Sandbox.State.STOPPING:
            messages.success(request, f"{sandbox.id} is stopping; its billing ends when it is gone.")
        else:
            messages.success(request, f"{sandbox.id} is {sandbox.state}.")  # it never reached a host
    else:
        messages.info(request, f"{sandbox.id} is already {sandbox.state}.")
    return redirect("console:sandbox", sandbox_id=sandbox.id)


@require_POST
@team_view(Action.RUN_SANDBOXES)
def sandbox_pause_view(request: HttpRequest, membership: Membership, sandbox_id: str, paused: bool) -> HttpResponse:
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    try:
        sandbox = sandbox_pause(sandbox=sandbox, paused=paused)
    except Refused as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{sandbox.id} is {sandbox.state}.")
    return redirect("console:sandbox", sandbox_id=sandbox.id)


@require_POST
@team_view(Action.RUN_SANDBOXES)
def sandbox_snapshot(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    sandbox = selectors.sandbox_for(membership.team, sandbox_id)
    form = SnapshotForm(request.POST)
    service_forms = ServiceFormSet(request.POST, prefix="services")
    if form.is_valid() and service_forms.is_valid():
        taken = [row.cleaned_data["service"] for row in service_forms if row.cleaned_data.get("service")]
        try:
            snapshot, _ = snapshot_create(
                team=membership.team, key=None, sandbox=sandbox, name=form.cleaned_data["name"], labels={}, services=taken
            )
        except Refused as error:
            messages.error(request, error.message)
        else:
            messages.success(request, f"Snapshot “{snapshot.name}” is being taken; {sandbox.id} keeps running.")
            return redirect("console:snapshot", snapshot_id=snapshot.id)
    return _detail(request, sandbox, status=400, snapshot_form=form, service_forms=service_forms, snapshot_open=True)
