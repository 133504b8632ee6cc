"""What each ``forkyard`` subcommand does: call the SDK, print the answer (a table, or JSON with ``--json``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from . import _forward
from . import _terminal as out
from ._calls import ExecOptions, ProcessOptions, SandboxOptions
from ._templates import TemplateSpec
from .client import Client, Files, Launch, Process, Sandbox, Snapshot
from .errors import ForkyardError, InvalidRequest, TemplateBuildFailed
from .models import ExecResult, ProcessOutput, Service, TemplateBuild

Handler = Callable[[Client, argparse.Namespace], int]
TIMED_OUT_EXIT = 124  # what timeout(1) exits with


def _json_mode(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


# --- sandboxes -------------------------------------------------------------------------


def _sandbox_row(sandbox: Sandbox) -> list[Any]:
    return [
        sandbox.id,
        sandbox.state,
        sandbox.host or "-",
        sandbox.size or f"{sandbox.cpu:g}cpu/{sandbox.memory_mib}MiB",
        sandbox.template,
        out.when(sandbox.created_at),
        out.labels_text(sandbox.labels),
    ]


SANDBOX_HEADERS = ["ID", "STATE", "HOST", "SIZE", "TEMPLATE", "CREATED", "LABELS"]


def _show_sandboxes(args: argparse.Namespace, sandboxes: list[Sandbox]) -> None:
    if _json_mode(args):
        out.print_json(sandboxes)
    else:
        out.table((_sandbox_row(sandbox) for sandbox in sandboxes), SANDBOX_HEADERS)


def _create_options(args: argparse.Namespace) -> SandboxOptions:
    options: SandboxOptions = {"ttl_s": args.ttl, "labels": dict(args.label), "env": dict(args.env)}
    if args.snapshot:
        options["snapshot"] = args.snapshot
    else:
        options["template"] = args.template
    if args.cpu is not None or args.memory_mib is not None:
        options.update({"cpu": args.cpu, "memory_mib": args.memory_mib})
    else:
        options["size"] = args.size
    if args.disk_mib is not None:
        options["disk_mib"] = args.disk_mib
    if args.network_policy:
        options["network_policy"] = args.network_policy
    if args.idempotency_key:
        options["idempotency_key"] = args.idempotency_key
    if args.idle_timeout:
        options["idle_timeout_s"] = args.idle_timeout
    return options


def create(fy: Client, args: argparse.Namespace) -> int:
    options = _create_options(args)
    options["wait"] = not args.no_wait
    sandbox = fy.sandboxes.create(**options)
    if args.quiet:
        print(sandbox.id)
    else:
        _show_sandboxes(args, [sandbox])
    return 0


def list_sandboxes(fy: Client, args: argparse.Namespace) -> int:
    if args.all:
        sandboxes = list(fy.sandboxes.list_all(state=args.state, label=args.label))
    else:
        page = fy.sandboxes.list(state=args.state, label=args.label, limit=args.limit)
        sandboxes = page.items
        if page.next_cursor and not _json_mode(args):
            print(f"(more: --limit or --all; next cursor {page.next_cursor})", file=sys.stderr)
    _show_sandboxes(args, sandboxes)
    return 0


def get(fy: Client, args: argparse.Namespace) -> int:
    sandbox = fy.sandboxes.get(args.sandbox)
    if _json_mode(args):
        out.print_json(sandbox)
        return 0
    for name, value in sandbox.data.items():
        print(f"{name + ':':16}{'-' if value is None else value}")
    return 0


def kill(fy: Client, args: argparse.Namespace) -> int:
    if args.label or args.launch:
        killed = fy.sandboxes.kill_all(label=args.label, launch=args.launch)
        if _json_mode(args):
            out.print_json(killed)
        else:
            print(f"asked {killed.count} sandboxes to stop ({killed.stopping} being destroyed, {killed.destroyed} gone at once)")
        return 0
    sandboxes = [fy.sandboxes.kill(sandbox_id, wait=not args.no_wait) for sandbox_id in args.sandboxes]
    _show_sandboxes(args, sandboxes)
    return 0


def update(fy: Client, args: argparse.Namespace) -> int:
    sandbox = fy.sandboxes.ref(args.sandbox).update(
        ttl_s=args.ttl,
        expires_at=args.expires_at,
        idle_timeout_s=args.idle_timeout,
        labels=dict(args.label) if args.label else None,
    )
    if _json_mode(args):
        out.print_json(sandbox)
    else:
        print(f"{sandbox.id}: expires {out.when(sandbox.expires_at)}, idle timeout {sandbox.idle_timeout_s or 'none'}")
    return 0


def metrics(fy: Client, args: argparse.Namespace) -> int:
    found = fy.launches.get(args.launch).metrics() if args.launch else fy.sandboxes.ref(args.sandbox).metrics()
    if _json_mode(args):
        out.print_json(found)
        return 0
    mib = 1 << 20
    rows = [
        [
            "cpu",
            f"{found.cpu_s:.2f} s of {found.cpu_limit:g} vCPU"
            + (f" ({found.cpu_share:.1%} of its share)" if found.sandbox else ""),
        ],
        [
            "memory",
            f"{found.memory_bytes / mib:.1f} MiB (peak {found.memory_peak_bytes / mib:.1f}) of {found.memory_limit_bytes / mib:.0f} MiB",
        ],
        ["pids", str(found.pids)],
        ["disk", f"{found.disk_used_bytes / mib:.1f} MiB" + ("" if found.disk_files is None else f", {found.disk_files} files")],
        ["oom kills", str(found.oom_kills)],
    ]
    if found.launch:
        rows.insert(0, ["sandboxes", f"{found.sandboxes} measured, {found.unreachable} unreachable"])
    out.table(rows, ["", found.sandbox or found.launch or ""])
    return 0


def pause(fy: Client, args: argparse.Namespace) -> int:
    _show_sandboxes(args, [fy.sandboxes.ref(sandbox_id).pause() for sandbox_id in args.sandboxes])
    return 0


def resume(fy: Client, args: argparse.Namespace) -> int:
    _show_sandboxes(args, [fy.sandboxes.ref(sandbox_id).resume() for sandbox_id in args.sandboxes])
    return 0


def _exit_code(exit_code: int, signal: int | None, timed_out: bool) -> int:
    if timed_out:
        return TIMED_OUT_EXIT
    if signal:
        return 128 + signal
    return exit_code if 0 <= exit_code <= 255 else 1


def _warn_incomplete(result: ExecResult, args: argparse.Namespace) -> None:
    if result.timed_out:
        print(f"error [timed_out]: the command ran past {args.timeout:g}s and was killed", file=sys.stderr)
    for name, cut in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
        if cut:
            print(f"warning: {name} was cut at {args.max_output} bytes (raise it with --max-output)", file=sys.stderr)


def exec_command(fy: Client, args: argparse.Namespace) -> int:
    many = bool(args.label or args.launch)
    words = ([args.sandbox] if many and args.sandbox else []) + list(args.command)  # with --label, no SANDBOX: it is a word
    words = words[1:] if words[:1] == ["--"] else words
    if not words:
        raise ForkyardError(
            "invalid_request", "give a command to run: forkyard exec SANDBOX -- COMMAND [ARG...]", field="command"
        )
    command: str | list[str] = words[0] if len(words) == 1 else list(words)
    # Output as base64 unless printing JSON: what the command wrote reaches stdout byte for byte.
    options: ExecOptions = {
        "env": dict(args.env),
        "timeout_s": args.timeout,
        "output": "text" if _json_mode(args) else "base64",
        "max_output_bytes": args.max_output,
    }
    if args.cwd:
        options["cwd"] = args.cwd
    if args.user:
        options["user"] = int(args.user) if args.user.isdigit() else args.user
    if args.stdin:
        options["stdin"] = sys.stdin.buffer.read()
    if many:
        return _exec_many(fy, args, command, options)
    sandbox = fy.sandboxes.ref(args.sandbox)
    if args.stream and not _json_mode(args):
        stream = sandbox.exec_stream(command, **options)
        for chunk in stream:
            target = sys.stdout if chunk.stream == "stdout" else sys.stderr
            target.buffer.write(chunk.bytes)
            target.flush()
        result = stream.result
        if result is None:
            raise ForkyardError("incomplete_stream", "the output stream ended before the command's exit status")
    else:
        result = sandbox.exec(command, **options)
        if _json_mode(args):
            out.print_json(result)
        else:
            sys.stdout.buffer.write(result.stdout_bytes)
            sys.stdout.flush()
            sys.stderr.buffer.write(result.stderr_bytes)
            sys.stderr.flush()
    if not _json_mode(args):
        _warn_incomplete(result, args)
    return _exit_code(result.exit_code, result.signal, result.timed_out)


def _prefixed(sandbox_id: str, data: bytes) -> bytes:
    """Output of one sandbox among many, each line led by the sandbox's id (as pdsh does)."""
    lines = data.splitlines(keepends=True)
    return b"".join(sandbox_id.encode() + b": " + (line if line.endswith(b"\n") else line + b"\n") for line in lines)


def _exec_many(fy: Client, args: argparse.Namespace, command: str | list[str], options: ExecOptions) -> int:
    """The command in every sandbox of a label or launch: each one's output as it finishes, its lines led by
    its id (``--json``: the API's lines); a summary on stderr; exit 0 only if it succeeded in every one."""
    batch = fy.exec_many(command, label=args.label, launch=args.launch, **options)
    for outcome in batch:
        if _json_mode(args):
            out.print_json(
                {
                    "sandbox_id": outcome.sandbox_id,
                    "result": outcome.result,
                    "error": outcome.error and {"code": outcome.error.code, "message": outcome.error.message},
                },
                compact=True,
            )
            continue
        if outcome.result is None:
            error = outcome.error
            print(
                f"{outcome.sandbox_id}: error [{error.code if error else 'unknown'}]: {error.message if error else ''}",
                file=sys.stderr,
            )
            continue
        sys.stdout.buffer.write(_prefixed(outcome.sandbox_id, outcome.result.stdout_bytes))
        sys.stdout.flush()
        sys.stderr.buffer.write(_prefixed(outcome.sandbox_id, outcome.result.stderr_bytes))
        if not outcome.result.ok:
            status = "timed out" if outcome.result.timed_out else f"exit {outcome.result.exit_code}"
            print(f"{outcome.sandbox_id}: {status}", file=sys.stderr)
        sys.stderr.flush()
    summary = batch.summary
    if summary is None:
        raise ForkyardError("incomplete_stream", "the batch's answer ended before its summary")
    if not _json_mode(args):
        print(
            f"{summary.sandboxes} sandboxes: {summary.succeeded} succeeded, {summary.failed} failed, "
            f"{summary.errors} could not run it ({summary.duration_ms / 1000:.2f}s)",
            file=sys.stderr,
        )
    return 0 if summary.succeeded == summary.sandboxes else 1


# --- launches --------------------------------------------------------------------------


def _launch_summary(launch: Launch) -> str:
    progress = launch.progress
    return (
        f"launch {launch.id} {launch.state}: {progress.running} running, {progress.failed} failed, {progress.pending} pending"
        f" of {progress.requested} in {launch.elapsed_s:.2f}s ({launch.rate_per_s:.1f}/s)"
    )


def _show_launches(args: argparse.Namespace, launches: list[Launch]) -> None:
    if _json_mode(args):
        out.print_json(launches)
        return
    rows = (
        [
            launch.id,
            launch.state,
            launch.template,
            launch.progress.requested,
            launch.progress.running,
            launch.progress.failed,
            f"{launch.rate_per_s:.1f}/s",
            out.when(launch.created_at),
        ]
        for launch in launches
    )
    out.table(rows, ["ID", "STATE", "TEMPLATE", "COUNT", "RUNNING", "FAILED", "RATE", "CREATED"])


def launch(fy: Client, args: argparse.Namespace) -> int:
    options = _create_options(args)
    created = fy.launches.create(count=args.count, **options)
    if args.wait:
        bar = out.ProgressBar(sys.stderr, enabled=args.progress if args.progress is not None else sys.stderr.isatty())
        try:
            for _ in created.wait(timeout_s=args.timeout, on_progress=bar.draw):
                pass  # the progress bar shows them as they come
        finally:
            bar.finish()
    if _json_mode(args):
        out.print_json(created)
    else:
        print(_launch_summary(created))
    return 1 if args.wait and created.progress.failed else 0


def launches(fy: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        _show_launches(args, fy.launches.list(limit=args.limit).items)
    elif args.action == "get":
        found = fy.launches.get(args.launch)
        if _json_mode(args):
            out.print_json(found)
        else:
            print(_launch_summary(found))
    else:
        _show_launches(args, [fy.launches.kill(args.launch)])
    return 0


# --- snapshots -------------------------------------------------------------------------


def services_of(args: argparse.Namespace) -> list[Service]:
    """The snapshot's services from ``--service NAME=COMMAND``, ``--ready NAME=CHECK`` and ``--ready-timeout NAME=S``."""
    commands, checks, timeouts = dict(args.service), dict(args.ready), dict(args.ready_timeout)
    for flag, names in (("--ready", checks), ("--ready-timeout", timeouts)):
        unknown = sorted(set(names) - set(commands))
        if unknown:
            raise ForkyardError("invalid_request", f"{flag} names no --service: {', '.join(unknown)}", field="services")
    unready = sorted(set(commands) - set(checks))
    if unready:
        raise ForkyardError(
            "invalid_request", f"give each service a --ready NAME=CHECK (missing: {', '.join(unready)})", field="services"
        )
    return [Service(name, command, checks[name], timeouts.get(name, 30.0)) for name, command in commands.items()]


def _show_snapshots(args: argparse.Namespace, found: list[Snapshot]) -> None:
    if _json_mode(args):
        out.print_json(found)
        return
    rows = (
        [
            item.id,
            item.name,
            item.state,
            out.size_of(item.size_bytes),
            item.forks_alive,
            item.parent or "-",
            ",".join(service.name for service in item.services) or "-",
            out.when(item.created_at),
        ]
        for item in found
    )
    out.table(rows, ["ID", "NAME", "STATE", "SIZE", "FORKS", "PARENT", "SERVICES", "CREATED"])


def _show_snapshot(args: argparse.Namespace, found: Snapshot) -> None:
    if _json_mode(args):
        out.print_json(found)
        return
    for name, value in found.data.items():
        if name == "services":
            value = "; ".join(
                f"{service.name} ({out.ready_text(service.ready)}): {service.command}" for service in found.services
            )
        print(f"{name + ':':16}{'-' if value is None or value == '' else value}")


def snapshot(fy: Client, args: argparse.Namespace) -> int:
    taken = fy.sandboxes.ref(args.sandbox).snapshot(
        name=args.name,
        services=services_of(args),
        labels=dict(args.label),
        idempotency_key=args.idempotency_key,
        wait=not args.no_wait,
        timeout_s=args.timeout,
    )
    if args.quiet:
        print(taken.id)
    else:
        _show_snapshots(args, [taken])
    return 0


def snapshots(fy: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        _show_snapshots(args, fy.snapshots.list(state=args.state, label=args.label, limit=args.limit).items)
    elif args.action == "get":
        _show_snapshot(args, fy.snapshots.get(args.snapshot))
    elif args.action == "import":
        _show_snapshot(args, fy.snapshots.import_image(args.archive, name=args.name, kind=args.kind, user=args.user))
    else:
        _show_snapshots(args, [fy.snapshots.delete(args.snapshot)])
    return 0


# --- account, templates, usage, files ----------------------------------------------------


def keys(fy: Client, args: argparse.Namespace) -> int:
    if args.action == "create":
        created = fy.keys.create(args.name, role=args.role)
        if _json_mode(args):
            out.print_json(created)
        else:
            print(f"key {created.key.id} ({created.key.name}, {created.key.role})")
            print(f"secret: {created.secret}")
            print("the secret is shown this once: store it now", file=sys.stderr)
        return 0
    found = [fy.keys.revoke(args.key)] if args.action == "revoke" else fy.keys.list().items
    if _json_mode(args):
        out.print_json(found)
    else:
        out.table(
            (
                [
                    key.id,
                    key.name,
                    key.prefix,
                    key.role,
                    out.when(key.created_at),
                    out.when(key.last_used_at),
                    out.when(key.revoked_at),
                ]
                for key in found
            ),
            ["ID", "NAME", "PREFIX", "ROLE", "CREATED", "LAST USED", "REVOKED"],
        )
    return 0


def build(fy: Client, args: argparse.Namespace) -> int:
    """Build a template from a spec file (a ``POST /templates`` body, as JSON): each step's progress on
    stderr as it moves, its output too with ``--logs``; the template once ready."""
    given, spec = TemplateSpec.from_file(args.spec)
    name = args.name or given.get("name")
    if not name:
        raise InvalidRequest("missing_name", 'name the template: --name, or a "name" in the spec', field="name")
    shown: dict[int, str] = {}

    def progress(build: TemplateBuild) -> None:
        for index, step in enumerate(build.steps):
            if shown.get(index) == step.state or step.state == "pending":
                continue
            shown[index] = step.state
            took = f" ({step.seconds:.1f} s)" if step.seconds and step.state == "done" else ""
            print(f"[{index + 1}/{len(build.steps)}] {step.name}: {step.state}{took}", file=sys.stderr, flush=True)

    def log(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    try:
        template = fy.templates.build(
            name, spec, description=args.description or given.get("description", ""), on_progress=progress,
            on_log=log if args.logs else None,
        )  # fmt: skip
    except TemplateBuildFailed as failed:
        if failed.output and not args.logs:
            sys.stderr.write(failed.output if failed.output.endswith("\n") else failed.output + "\n")
        raise
    if _json_mode(args):
        out.print_json(template)
    else:
        print(template.name)
    return 0


def templates(fy: Client, args: argparse.Namespace) -> int:
    if args.delete:
        if not args.name:
            raise InvalidRequest("missing_name", "--delete needs the template's name", field="name")
        fy.templates.delete(args.name)
        print(f"deleted {args.name}")
        return 0
    found = [fy.templates.get(args.name)] if args.name else fy.templates.list().items
    if _json_mode(args):
        out.print_json(found)
    else:
        out.table(
            (
                [template.name, out.size_of(template.size_bytes), ",".join(template.hosts) or "-", template.description]
                for template in found
            ),
            ["NAME", "SIZE", "HOSTS", "DESCRIPTION"],
        )
    return 0


def usage(fy: Client, args: argparse.Namespace) -> int:
    report = fy.usage(start=args.start, end=args.end, group_by=args.group_by)
    if _json_mode(args):
        out.print_json(report)
        return 0
    print(f"usage from {out.when(report.start)} to {out.when(report.end)}, by {report.group_by}")
    rows = [[line.group, f"{line.seconds:,.1f}", line.periods, out.money(line.amount, report.currency)] for line in report.lines]
    rows.append(["total", "", "", out.money(report.total, report.currency)])
    out.table(rows, ["GROUP", "SECONDS", "PERIODS", "AMOUNT"])
    return 0


def whoami(fy: Client, args: argparse.Namespace) -> int:
    me = fy.me()
    if _json_mode(args):
        out.print_json(me)
        return 0
    print(f"team {me.team_name} ({me.team}), key {me.key_name} ({me.key}), role {me.role}, at {fy.url}")
    limits = me.limits
    print(
        f"limits: {limits.requests_per_second} requests/s, {limits.max_sandboxes} sandboxes, "
        f"{limits.max_launch_count} per launch, ttl up to {limits.max_ttl_s}s"
    )
    return 0


def files(fy: Client, args: argparse.Namespace) -> int:
    sandbox_files = fy.sandboxes.ref(args.sandbox).files
    if args.action == "read":
        data = sandbox_files.read(args.path)
        if args.output and args.output != "-":
            with open(args.output, "wb") as target:
                target.write(data)
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
    elif args.action == "write":
        if args.source == "-":
            written = sandbox_files.write(args.path, sys.stdin.buffer, mode=args.mode)
        else:
            with open(args.source, "rb") as source:
                written = sandbox_files.write(args.path, source, mode=args.mode)
        if _json_mode(args):
            out.print_json(written)
        else:
            print(f"wrote {written.bytes} bytes to {written.path}")
    elif args.action == "rm":
        sandbox_files.remove(args.path, recursive=args.recursive)
    elif args.action in ("stat", "mkdir", "mv", "watch", "upload-dir", "download-dir"):
        return _more_files(sandbox_files, args)
    else:
        listing = sandbox_files.list(args.path)
        if _json_mode(args):
            out.print_json(listing)
        else:
            out.table(
                (
                    [
                        f"{entry.mode:o}",
                        entry.type,
                        entry.size,
                        entry.name + (f" -> {entry.link_target}" if entry.link_target else ""),
                    ]
                    for entry in listing
                ),
                ["MODE", "TYPE", "SIZE", "NAME"],
            )
    return 0


def _more_files(sandbox_files: Files, args: argparse.Namespace) -> int:
    """``files stat``, ``mkdir``, ``mv``, ``watch``, ``upload-dir`` and ``download-dir``."""
    if args.action == "stat":
        entry = sandbox_files.stat(args.path)
        if _json_mode(args):
            out.print_json(entry)
        else:
            link = f" -> {entry.link_target}" if entry.link_target else ""
            print(f"{entry.mode:o} {entry.type} {entry.size} {entry.uid}:{entry.gid} {args.path}{link}")
    elif args.action == "mkdir":
        sandbox_files.mkdir(args.path)
    elif args.action == "mv":
        sandbox_files.rename(args.path, args.target, replace=args.replace)
    elif args.action == "watch":
        with sandbox_files.watch(args.path, timeout_s=args.timeout) as watch:
            for event in watch:
                print(json.dumps({key: value for key, value in vars(event).items() if value not in (None, 0, False)}))
                sys.stdout.flush()
    elif args.action == "upload-dir":
        sandbox_files.upload_dir(args.local, args.remote)
    else:
        count = sandbox_files.download_dir(args.remote, args.local)
        print(f"{count} entries into {args.local}")
    return 0


# --- background processes --------------------------------------------------------------


def _terminal_size(text: str) -> dict[str, int]:
    rows, _, cols = text.lower().partition("x")
    if not (rows.isdigit() and cols.isdigit()):
        raise ForkyardError("invalid_request", f"--pty takes ROWSxCOLS, such as 24x80, not {text!r}", field="pty")
    return {"rows": int(rows), "cols": int(cols)}


def _write_output(output: ProcessOutput) -> None:
    for stream, target in ((output.stdout, sys.stdout), (output.stderr, sys.stderr)):
        if stream.missed_bytes:
            print(f"warning: {stream.missed_bytes} bytes of its output were dropped before they were read", file=sys.stderr)
        target.buffer.write(stream.bytes)
        target.flush()


def _process_row(process: Process) -> list[Any]:
    ended = process.exit_code if process.exit_signal is None else f"signal {process.exit_signal}"
    return [process.pid, process.state, "-" if ended is None else ended, out.when(process.started_at), " ".join(process.cmd)]


def ports(fy: Client, args: argparse.Namespace) -> int:
    sandbox = fy.sandboxes.ref(args.sandbox)
    if args.action == "wait":
        sandbox.ports.wait_for_port(args.port, timeout_s=args.timeout)
        return 0
    if args.action == "close":
        sandbox.ports.close(args.port)
        return 0
    if args.action == "forward":
        settings = fy._sender.settings

        def ready(local_port: int) -> None:
            print(f"forwarding 127.0.0.1:{local_port} -> {args.sandbox} port {args.port} (Ctrl-C ends it)", flush=True)

        return _forward.run(settings.url, settings.api_key, args.sandbox, args.port, args.local, ready)
    if args.action == "expose":
        port = sandbox.ports.expose(args.port, auth=args.auth, token_ttl_s=args.token_ttl)
        if _json_mode(args):
            out.print_json(port)
        else:
            print(port.token_url or port.url)
        return 0
    found = sandbox.ports.list()
    if _json_mode(args):
        out.print_json(found)
    else:
        out.table(([str(port.port), port.auth, port.url] for port in found), ["PORT", "AUTH", "URL"])
    return 0


def processes(fy: Client, args: argparse.Namespace) -> int:
    sandbox = fy.sandboxes.ref(args.sandbox)
    if args.action == "start":
        words = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not words:
            raise ForkyardError("invalid_request", "give a command: forkyard processes start SANDBOX -- COMMAND", field="command")
        options: ProcessOptions = {"env": dict(args.env), "output": "base64"}
        if args.cwd:
            options["cwd"] = args.cwd
        if args.timeout is not None:
            options["timeout_s"] = args.timeout
        if args.pty:
            options["pty"] = _terminal_size(args.pty)
        process = sandbox.processes.start(words[0] if len(words) == 1 else list(words), **options)
        if _json_mode(args):
            out.print_json(process)
        elif not process.pid:  # it could not start (the reason is on its stderr)
            _write_output(process.output())
        else:
            print(process.pid)
        return 0 if process.pid else _exit_code(process.exit_code or 1, None, False)
    if args.action == "list":
        found = sandbox.processes.list()
        if _json_mode(args):
            out.print_json(found)
        else:
            out.table((_process_row(process) for process in found), ["PID", "STATE", "EXIT", "STARTED", "COMMAND"])
        return 0
    process = sandbox.processes.get(args.pid)
    if args.action == "signal":
        process.signal(args.signal, group=args.group)
        return 0
    if args.action == "logs":
        _write_output(process.output())
        while args.follow and process.running:
            process.wait(timeout_s=1.0)  # returns as soon as it exits, or after a second with what came
            _write_output(process.output())
        return 0
    _write_output(process.output())
    process.wait(timeout_s=args.timeout)
    _write_output(process.output())
    if process.running:
        print(f"error [wait_timeout]: process {process.pid} still runs after {args.timeout:g}s", file=sys.stderr)
        return TIMED_OUT_EXIT
    return _exit_code(process.exit_code or 0, process.exit_signal, process.timed_out)
