"""The console's pages about sandboxes, launches, templates, snapshots and network policies.

Views parse, check the caller's role (console.access.team_view) and call a
selector or a service; the command box goes to the owning host's engine like
the API's exec does, and its output is rendered once, never stored.
"""

from __future__ import annotations

from typing import Any, TypedDict

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST
from django.views.decorators.vary import vary_on_headers

from billing.charts import sandbox_spend, snapshot_saved_state
from console.access import HtmxRequest, team_view
from console.errors import ApiError, from_engine
from console.models import Membership, Role, Team
from sandboxes.engine.client import ExecOutput
from sandboxes.engine.errors import EngineError

from . import listings, policies, selectors, services, snapshots
from .engine_link import engine
from .forms import (
    ExecForm,
    LaunchFromSnapshotForm,
    PolicyForm,
    SandboxFilterForm,
    ServiceFormSet,
    SnapshotForm,
    egress_text,
)
from .models import Launch, NetworkPolicy, Sandbox, Snapshot

OUTPUT_CAP = 256 * 1024  # per stream: a page, not a download


def _sandbox_or_404(team: Team, sandbox_id: str) -> Sandbox:
    sandbox = (
        Sandbox.objects.select_related("host", "launch", "network_policy", "api_key", "snapshot")
        .filter(team=team, pk=sandbox_id)
        .first()
    )
    if sandbox is None:
        raise Http404("No such sandbox in this team.")
    return sandbox


def _launch_or_404(team: Team, launch_id: str) -> Launch:
    launch = Launch.objects.select_related("snapshot", "network_policy").filter(team=team, pk=launch_id).first()
    if launch is None:
        raise Http404("No such launch in this team.")
    return launch


def _policy_or_404(team: Team, policy_id: str) -> NetworkPolicy:
    policy = NetworkPolicy.objects.filter(team=team, pk=policy_id).first()
    if policy is None:
        raise Http404("No such network policy in this team.")
    return policy


# --- sandboxes --------------------------------------------------------------------------


@vary_on_headers("HX-Request")
@team_view()
def sandbox_list(request: HtmxRequest, membership: Membership) -> HttpResponse:
    form = SandboxFilterForm(request.GET)
    form.is_valid()  # a field that does not validate shows its error and filters nothing
    state = form.cleaned_data.get("state") or None
    label = form.cleaned_data.get("label") or None
    cursor = listings.valid_cursor(form.cleaned_data.get("cursor"))
    rows, next_cursor = selectors.sandboxes_page(membership.team, state, label, listings.PAGE_SIZE, cursor)
    counts = listings.state_counts(membership.team, label)
    context = {
        "form": form,
        "sandboxes": rows,
        "next_cursor": next_cursor,
        "paged": bool(cursor),
        "counts": [(value, name, counts.get(value, 0)) for value, name in Sandbox.State.choices],
        "total": sum(counts.values()),
        "matching": counts.get(state, 0) if state else sum(counts.values()),
    }
    template = "sandboxes/_sandbox_table.html" if request.htmx else "sandboxes/sandbox_list.html"
    return render(request, template, context)


def _snapshot_or_404(team: Team, snapshot_id: str) -> Snapshot:
    rows = selectors.with_forks_alive(Snapshot.objects.select_related("host", "parent", "source_sandbox"))
    snapshot = rows.filter(team=team, pk=snapshot_id).exclude(state=Snapshot.State.DELETED).first()
    if snapshot is None:
        raise Http404("No such snapshot in this team.")
    return snapshot


def _detail(request: HttpRequest, sandbox: Sandbox, status: int = 200, **extra: Any) -> HttpResponse:
    seconds, spent = sandbox_spend(sandbox)
    context = {
        "sandbox": sandbox,
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
    return _detail(request, _sandbox_or_404(membership.team, sandbox_id))


class ExecOutcome(TypedDict):
    """What a command run from the console shows: on the whole page, or as its htmx fragment."""

    exec_form: ExecForm
    result: ExecOutput | None
    exec_error: str | None


def _run(sandbox: Sandbox, cmd: str, timeout_s: float) -> tuple[ExecOutput | None, str | None]:
    """(output, None) or (None, a sentence for the page); the API's exec, run from a view."""
    if sandbox.state not in (Sandbox.State.RUNNING, Sandbox.State.PAUSED) or not sandbox.engine_id or sandbox.host is None:
        return None, f"This sandbox is {sandbox.state}: commands run only while it runs."
    try:
        client = engine(sandbox.host.engine_socket)
        return client.exec(sandbox.engine_id, cmd, timeout_s=timeout_s, max_output_bytes=OUTPUT_CAP), None
    except EngineError as error:
        return None, from_engine(error).message


@never_cache  # the output is the caller's alone, and is not kept anywhere
@vary_on_headers("HX-Request")
@require_POST
@team_view(action="run commands")
def sandbox_exec(request: HtmxRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    sandbox = _sandbox_or_404(membership.team, sandbox_id)
    form = ExecForm(request.POST)
    result, error = None, None
    if form.is_valid():
        result, error = _run(sandbox, form.cleaned_data["cmd"], form.cleaned_data["timeout_s"])
    outcome: ExecOutcome = {"exec_form": form, "result": result, "exec_error": error}
    if request.htmx:
        return render(request, "sandboxes/_exec.html", {"sandbox": sandbox, **outcome})
    return _detail(request, sandbox, **outcome)


@require_POST
@team_view(action="kill sandboxes")
def sandbox_kill(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    sandbox = _sandbox_or_404(membership.team, sandbox_id)
    if sandbox.live:
        sandbox = services.sandbox_destroy(sandbox=sandbox)
        if sandbox.state == Sandbox.State.STOPPING:
            messages.success(request, f"{sandbox.id} is stopping; its billing ends when it is gone.")
        else:
            messages.success(request, f"{sandbox.id} is {sandbox.state}.")  # it never reached a host
    else:
        messages.info(request, f"{sandbox.id} is already {sandbox.state}.")
    return redirect("console:sandbox", sandbox_id=sandbox.id)


@require_POST
@team_view(action="pause sandboxes")
def sandbox_pause(request: HttpRequest, membership: Membership, sandbox_id: str, paused: bool) -> HttpResponse:
    sandbox = _sandbox_or_404(membership.team, sandbox_id)
    try:
        sandbox = services.sandbox_pause(sandbox=sandbox, paused=paused)
    except ApiError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{sandbox.id} is {sandbox.state}.")
    return redirect("console:sandbox", sandbox_id=sandbox.id)


@require_POST
@team_view(action="take snapshots")
def sandbox_snapshot(request: HttpRequest, membership: Membership, sandbox_id: str) -> HttpResponse:
    sandbox = _sandbox_or_404(membership.team, sandbox_id)
    form = SnapshotForm(request.POST)
    service_forms = ServiceFormSet(request.POST, prefix="services")
    if form.is_valid() and service_forms.is_valid():
        taken = [row.cleaned_data["service"] for row in service_forms if row.cleaned_data.get("service")]
        try:
            snapshot, _ = snapshots.snapshot_create(
                team=membership.team, key=None, sandbox=sandbox, name=form.cleaned_data["name"], labels={}, services=taken
            )
        except ApiError as error:
            messages.error(request, error.message)
        else:
            messages.success(request, f"Snapshot “{snapshot.name}” is being taken; {sandbox.id} keeps running.")
            return redirect("console:snapshot", snapshot_id=snapshot.id)
    return _detail(request, sandbox, status=400, snapshot_form=form, service_forms=service_forms, snapshot_open=True)


# --- launches -----------------------------------------------------------------------------


@team_view()
def launch_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    page = listings.launches_page(membership.team, request.GET.get("cursor"))
    return render(request, "sandboxes/launch_list.html", {"page": page})


def _index(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() and len(value) < 10 else None


@vary_on_headers("HX-Request")
@team_view()
def launch_detail(request: HtmxRequest, membership: Membership, launch_id: str) -> HttpResponse:
    launch = _launch_or_404(membership.team, launch_id)
    context: dict[str, Any] = {"launch": launch, "out": selectors.launch_out(launch)}
    if request.htmx:  # the progress panel polls itself while the launch starts
        return render(request, "sandboxes/_launch_progress.html", context)
    rows, next_index = listings.launch_sandboxes(launch, _index(request.GET.get("after")))
    return render(request, "sandboxes/launch_detail.html", {**context, "sandboxes": rows, "next_index": next_index})


# --- templates and snapshots ---------------------------------------------------------------


@team_view()
def template_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    return render(request, "sandboxes/template_list.html", {"templates": listings.templates_for(membership.team)})


@team_view()
def snapshot_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    page = listings.snapshots_page(membership.team, request.GET.get("cursor"))
    return render(request, "sandboxes/snapshot_list.html", {"page": page})


def _snapshot_page(request: HttpRequest, snapshot: Snapshot, launch_form: LaunchFromSnapshotForm | None = None) -> HttpResponse:
    seconds, spent = snapshot_saved_state(snapshot)
    context = {
        "snapshot": snapshot,
        "users": snapshots.users_of(snapshot),
        "children": listings.snapshot_children(snapshot),
        "launch_form": launch_form or LaunchFromSnapshotForm(sizes=sorted(services.sizes())),
        "billed_seconds": seconds,
        "spent": spent,
    }
    return render(request, "sandboxes/snapshot_detail.html", context, status=400 if launch_form else 200)


@vary_on_headers("HX-Request")
@team_view()
def snapshot_detail(request: HtmxRequest, membership: Membership, snapshot_id: str) -> HttpResponse:
    snapshot = _snapshot_or_404(membership.team, snapshot_id)
    if request.htmx:  # the state panel polls itself while the snapshot is taken
        return render(request, "sandboxes/_snapshot_state.html", {"snapshot": snapshot})
    return _snapshot_page(request, snapshot)


@require_POST
@team_view(action="delete snapshots")
def snapshot_delete(request: HttpRequest, membership: Membership, snapshot_id: str) -> HttpResponse:
    snapshot = _snapshot_or_404(membership.team, snapshot_id)
    try:
        snapshots.snapshot_delete(snapshot=snapshot)
    except ApiError as error:
        messages.error(request, error.message)
        return redirect("console:snapshot", snapshot_id=snapshot.id)
    messages.success(request, f"Snapshot “{snapshot.name}” deleted; its saved-state billing has ended.")
    return redirect("console:snapshots")


@require_POST
@team_view(action="launch sandboxes")
def snapshot_launch(request: HttpRequest, membership: Membership, snapshot_id: str) -> HttpResponse:
    snapshot = _snapshot_or_404(membership.team, snapshot_id)
    form = LaunchFromSnapshotForm(request.POST, sizes=sorted(services.sizes()))
    if not form.is_valid():
        return _snapshot_page(request, snapshot, launch_form=form)
    spec = services.CreateSpec(snapshot=snapshot.id, size=form.cleaned_data["size"], ttl_s=form.cleaned_data["ttl_s"])
    try:
        launch, _ = services.launch_create(team=membership.team, key=None, spec=spec, count=form.cleaned_data["count"])
    except ApiError as error:
        messages.error(request, error.message)
        return redirect("console:snapshot", snapshot_id=snapshot.id)
    messages.success(request, f"Launching {launch.count} forks of “{snapshot.name}”.")
    return redirect("console:launch", launch_id=launch.id)


# --- network policies -------------------------------------------------------------------------


@team_view()
def policy_list(request: HttpRequest, membership: Membership) -> HttpResponse:
    return render(request, "sandboxes/policy_list.html", {"policies": listings.policies_of(membership.team)})


def _save_policy(request: HttpRequest, membership: Membership, policy: NetworkPolicy | None) -> HttpResponse:
    initial = {}
    if policy is not None:
        initial = {"name": policy.name, "description": policy.description, "egress": egress_text(policy.egress)}
    form = PolicyForm(request.POST if request.method == "POST" else None, initial=initial)
    if form.is_valid():
        try:
            saved = policies.policy_save(team=membership.team, policy=policy, **form.cleaned_data)
        except ApiError as error:
            # The service has the last word (a name taken meanwhile): shown at its field.
            field = (error.field or "").split(".")[0]
            form.add_error(field if field in form.fields else None, error.message)
        else:
            messages.success(request, f"Network policy “{saved.name}” saved.")
            return redirect("console:policies")
    return render(request, "sandboxes/policy_form.html", {"form": form, "policy": policy})


@team_view(Role.ADMIN, "manage network policies")
def policy_new(request: HttpRequest, membership: Membership) -> HttpResponse:
    return _save_policy(request, membership, None)


@team_view(Role.ADMIN, "manage network policies")
def policy_edit(request: HttpRequest, membership: Membership, policy_id: str) -> HttpResponse:
    return _save_policy(request, membership, _policy_or_404(membership.team, policy_id))


@team_view(Role.ADMIN, "manage network policies")
def policy_delete(request: HttpRequest, membership: Membership, policy_id: str) -> HttpResponse:
    policy = _policy_or_404(membership.team, policy_id)
    if request.method != "POST":
        return render(request, "sandboxes/policy_delete.html", {"policy": policy})
    try:
        policies.policy_delete(policy=policy)
    except ApiError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Network policy “{policy.name}” deleted.")
    return redirect("console:policies")
