"""``forkyard``: the command line over the SDK.

    forkyard create --template base --size tiny         # prints the new sandbox
    forkyard exec sb_123 uname -a                       # its stdout/stderr, its exit code
    forkyard launch --template base --count 1000 --wait # a progress bar, then counts and rate
    forkyard list --state running --json

FORKYARD_URL and FORKYARD_API_KEY say where and who; ``--url`` and
``--api-key`` override them, ``--json`` prints what the API answered.  An
error prints ``error [code]: message`` and exits 1 (usage errors exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from . import _terminal as out
from ._calls import ExecOptions, SandboxOptions
from ._version import __version__
from .client import Client, Launch, Sandbox
from .errors import ForkyardError

Handler = Callable[[Client, argparse.Namespace], int]
TIMED_OUT_EXIT = 124  # what timeout(1) exits with


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _time(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 time (2026-01-31 or 2026-01-31T12:00:00+00:00), got {text!r}") from error


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected an octal mode such as 644, got {text!r}") from error


def _json_mode(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "json", False))


# --- sandboxes -------------------------------------------------------------------------


def _sandbox_row(sandbox: Sandbox) -> list[Any]:
    return [sandbox.id, sandbox.state, sandbox.host or "-", sandbox.size or f"{sandbox.cpu:g}cpu/{sandbox.memory_mib}MiB",
            sandbox.template, out.when(sandbox.created_at), out.labels_text(sandbox.labels)]


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
    if args.network_policy:
        options["network_policy"] = args.network_policy
    if args.idempotency_key:
        options["idempotency_key"] = args.idempotency_key
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
    sandboxes = [fy.sandboxes.kill(sandbox_id, wait=not args.no_wait) for sandbox_id in args.sandboxes]
    _show_sandboxes(args, sandboxes)
    return 0


def _exit_code(exit_code: int, signal: int | None, timed_out: bool) -> int:
    if timed_out:
        return TIMED_OUT_EXIT
    if signal:
        return 128 + signal
    return exit_code if 0 <= exit_code <= 255 else 1


def exec_command(fy: Client, args: argparse.Namespace) -> int:
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not words:
        raise ForkyardError("invalid_request", "give a command to run: forkyard exec SANDBOX -- COMMAND [ARG...]", field="command")
    command: str | list[str] = words[0] if len(words) == 1 else list(words)
    options: ExecOptions = {"env": dict(args.env), "timeout_s": args.timeout}
    if args.cwd:
        options["cwd"] = args.cwd
    if args.stdin:
        options["stdin"] = sys.stdin.buffer.read()
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
    if result.timed_out and not _json_mode(args):
        print(f"error [timed_out]: the command ran past {args.timeout:g}s and was killed", file=sys.stderr)
    return _exit_code(result.exit_code, result.signal, result.timed_out)


# --- launches --------------------------------------------------------------------------


def _launch_summary(launch: Launch) -> str:
    progress = launch.progress
    return (f"launch {launch.id} {launch.state}: {progress.running} running, {progress.failed} failed, {progress.pending} pending"
            f" of {progress.requested} in {launch.elapsed_s:.2f}s ({launch.rate_per_s:.1f}/s)")


def _show_launches(args: argparse.Namespace, launches: list[Launch]) -> None:
    if _json_mode(args):
        out.print_json(launches)
        return
    rows = ([launch.id, launch.state, launch.template, launch.progress.requested, launch.progress.running, launch.progress.failed,
             f"{launch.rate_per_s:.1f}/s", out.when(launch.created_at)] for launch in launches)
    out.table(rows, ["ID", "STATE", "TEMPLATE", "COUNT", "RUNNING", "FAILED", "RATE", "CREATED"])


def launch(fy: Client, args: argparse.Namespace) -> int:
    options = _create_options(args)
    created = fy.launches.create(count=args.count, **options)
    if args.wait:
        bar = out.ProgressBar(sys.stderr, enabled=args.progress if args.progress is not None else sys.stderr.isatty())
        try:
            created.wait(timeout_s=args.timeout, on_progress=bar.draw)
        finally:
            bar.finish()
    if _json_mode(args):
        out.print_json(created)
    else:
        print(_launch_summary(created))
    return 1 if args.wait and created.progress.failed else 0


def launches(fy: Client, args: argparse.Namespace) -> int:
    if args.action == "list":
        _show_launches(args, fy.launches.list(limit=args.limit))
    elif args.action == "get":
        found = fy.launches.get(args.launch)
        if _json_mode(args):
            out.print_json(found)
        else:
            print(_launch_summary(found))
    else:
        _show_launches(args, [fy.launches.kill(args.launch)])
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
    found = [fy.keys.revoke(args.key)] if args.action == "revoke" else fy.keys.list()
    if _json_mode(args):
        out.print_json(found)
    else:
        out.table(([key.id, key.name, key.prefix, key.role, out.when(key.created_at), out.when(key.last_used_at),
                    out.when(key.revoked_at)] for key in found), ["ID", "NAME", "PREFIX", "ROLE", "CREATED", "LAST USED", "REVOKED"])
    return 0


def templates(fy: Client, args: argparse.Namespace) -> int:
    found = [fy.templates.get(args.name)] if args.name else fy.templates.list()
    if _json_mode(args):
        out.print_json(found)
    else:
        out.table(([template.name, out.size_of(template.size_bytes), ",".join(template.hosts) or "-", template.description]
                   for template in found), ["NAME", "SIZE", "HOSTS", "DESCRIPTION"])
    return 0


def usage(fy: Client, args: argparse.Namespace) -> int:
    report = fy.usage(start=args.start, end=args.end, group_by=args.group_by)
    if _json_mode(args):
        out.print_json(report)
        return 0
    print(f"usage from {out.when(report.start)} to {out.when(report.end)}, by {report.group_by}")
    rows = [[line.group, f"{line.seconds:.1f}", line.periods, f"{line.amount} {report.currency}"] for line in report.lines]
    rows.append(["total", "", "", f"{report.total} {report.currency}"])
    out.table(rows, ["GROUP", "SECONDS", "PERIODS", "AMOUNT"])
    return 0


def whoami(fy: Client, args: argparse.Namespace) -> int:
    me = fy.me()
    if _json_mode(args):
        out.print_json(me)
        return 0
    print(f"team {me.team_name} ({me.team}), key {me.key_name} ({me.key}), role {me.role}, at {fy.url}")
    limits = me.limits
    print(f"limits: {limits.requests_per_second} requests/s, {limits.max_sandboxes} sandboxes, "
          f"{limits.max_launch_count} per launch, ttl up to {limits.max_ttl_s}s")
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
    else:
        listing = sandbox_files.list(args.path)
        if _json_mode(args):
            out.print_json(listing)
        else:
            out.table(([f"{entry.mode:o}", entry.type, entry.size, entry.name + (f" -> {entry.link_target}" if entry.link_target else "")]
                       for entry in listing), ["MODE", "TYPE", "SIZE", "NAME"])
    return 0


# --- the parser ------------------------------------------------------------------------


def _add_create_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--template", default="base", help="template to start from (default: base)")
    parser.add_argument("--snapshot", help="snapshot id to fork instead of a template")
    parser.add_argument("--size", default="tiny", help="tiny, default, or another size on the rate card (default: tiny)")
    parser.add_argument("--cpu", type=float, help="explicit vCPUs (with --memory-mib, instead of --size)")
    parser.add_argument("--memory-mib", type=int, help="explicit memory in MiB (with --cpu)")
    parser.add_argument("--ttl", type=int, default=3600, help="seconds it lives once ready (default: 3600)")
    parser.add_argument("--label", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--env", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--network-policy", metavar="POLICY_ID")
    parser.add_argument("--idempotency-key", help="a retry with the same key creates nothing new")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help="the API (default: $FORKYARD_URL)")
    common.add_argument("--api-key", default=argparse.SUPPRESS, help="an API key (default: $FORKYARD_API_KEY)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print what the API answered, as JSON")
    parser = argparse.ArgumentParser(prog="forkyard", parents=[common], description="Sandboxes for RL rollouts, from the shell.")
    parser.add_argument("--version", action="version", version=f"forkyard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Handler, summary: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, parents=[common], help=summary, description=summary)
        sub.set_defaults(handler=handler)
        return sub

    sub = command("create", create, "create a sandbox")
    _add_create_options(sub)
    sub.add_argument("--no-wait", action="store_true", help="answer once it is queued, not once it runs")
    sub.add_argument("-q", "--quiet", action="store_true", help="print only the new sandbox's id")

    sub = command("list", list_sandboxes, "list sandboxes, newest first")
    sub.add_argument("--state", help="queued, creating, running, paused, stopping, stopped, failed or destroyed")
    sub.add_argument("--label", help="KEY=VALUE or KEY")
    sub.add_argument("--limit", type=int, default=100)
    sub.add_argument("--all", action="store_true", help="every page")

    command("get", get, "show a sandbox").add_argument("sandbox")

    sub = command("kill", kill, "destroy sandboxes")
    sub.add_argument("sandboxes", nargs="+", metavar="SANDBOX")
    sub.add_argument("--no-wait", action="store_true", help="answer at once, not once they are gone")

    sub = command("exec", exec_command, "run a command in a sandbox; exits with its exit code")
    sub.add_argument("--cwd")
    sub.add_argument("--env", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    sub.add_argument("--timeout", type=float, default=60.0, help="seconds before it is killed (exit 124)")
    sub.add_argument("--stdin", action="store_true", help="pass this command's standard input on")
    sub.add_argument("--stream", action="store_true", help="print the output as it comes")
    sub.add_argument("sandbox")
    sub.add_argument("command", nargs=argparse.REMAINDER, help="one word runs under /bin/sh -c; several are argv")

    sub = command("launch", launch, "launch many sandboxes at once")
    _add_create_options(sub)
    sub.add_argument("--count", type=int, required=True)
    sub.add_argument("--wait", action="store_true", help="wait until every sandbox runs or failed (exit 1 if any failed)")
    sub.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds")
    sub.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="draw a progress bar on stderr (default: when it is a terminal)")

    sub = command("launches", launches, "list, show or tear down launches")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common]).add_argument("--limit", type=int, default=50)
    actions.add_parser("get", parents=[common]).add_argument("launch")
    actions.add_parser("kill", parents=[common]).add_argument("launch")

    sub = command("keys", keys, "list, create or revoke API keys")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common])
    create_key = actions.add_parser("create", parents=[common])
    create_key.add_argument("name")
    create_key.add_argument("--role", choices=["member", "admin"], default="member")
    actions.add_parser("revoke", parents=[common]).add_argument("key")

    command("templates", templates, "list templates, or show one").add_argument("name", nargs="?")

    sub = command("usage", usage, "sandbox-seconds and cost")
    sub.add_argument("--start", type=_time)
    sub.add_argument("--end", type=_time)
    sub.add_argument("--group-by", default="size", help="size, key, day, all or label:KEY")

    sub = command("files", files, "read, write, list or remove files in a sandbox")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    read = actions.add_parser("read", parents=[common])
    read.add_argument("sandbox")
    read.add_argument("path")
    read.add_argument("-o", "--output", help="write to this file instead of stdout")
    write = actions.add_parser("write", parents=[common])
    write.add_argument("sandbox")
    write.add_argument("path")
    write.add_argument("source", nargs="?", default="-", help="a local file, or - for stdin (the default)")
    write.add_argument("--mode", type=_octal, default=0o644)
    listing = actions.add_parser("ls", parents=[common])
    listing.add_argument("sandbox")
    listing.add_argument("path", nargs="?", default="/")
    remove = actions.add_parser("rm", parents=[common])
    remove.add_argument("sandbox")
    remove.add_argument("path")
    remove.add_argument("-r", "--recursive", action="store_true")

    command("whoami", whoami, "the key, its team and its limits")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(getattr(args, "url", None), getattr(args, "api_key", None)) as fy:
            code: int = args.handler(fy, args)
            return code
    except ForkyardError as error:
        field = f" (field {error.field})" if error.field else ""
        print(f"error [{error.code}]: {error.message}{field}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (``forkyard files read ... | head``): stop quietly, like cat does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as error:
        print(f"error [local]: {error.strerror or error}{f': {error.filename}' if error.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - a command line prints a line, never a traceback
        print(f"error [unexpected]: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
