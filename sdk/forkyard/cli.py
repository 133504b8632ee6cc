"""``forkyard``: the command line over the SDK.

    forkyard create --template base --size tiny         # prints the new sandbox
    forkyard exec sb_123 uname -a                       # its stdout/stderr, its exit code
    forkyard exec --label run:7 -- pytest -q            # in every sandbox with the label, as each finishes
    forkyard kill --label run:7                         # every sandbox with the label (or --launch ID)
    forkyard launch --template base --count 1000 --wait # a progress bar, then counts and rate
    forkyard list --state running --json
    forkyard snapshot sb_123 --name web-ready \
        --service 'web=httpd -f -p 8080 -h /srv' --ready web=tcp:8080   # waits until it is ready
    forkyard launch --snapshot snap_456 --count 100 --wait              # fork it 100 times
    forkyard build env.json --logs                      # a template from a spec file, step by step

FORKYARD_URL and FORKYARD_API_KEY say where and who; ``--url`` and
``--api-key`` override them, ``--json`` prints what the API answered.  An
error prints ``error [code]: message`` and exits 1 (usage errors exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ._commands import (
    Handler,
    build,
    create,
    exec_command,
    files,
    get,
    keys,
    kill,
    launch,
    launches,
    list_sandboxes,
    metrics,
    pause,
    ports,
    processes,
    resume,
    snapshot,
    snapshots,
    templates,
    update,
    usage,
    whoami,
)
from ._version import __version__
from .client import Client
from .errors import ForkyardError


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _ready(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=tcp:PORT``, ``NAME=http:PORT[/PATH]`` or ``NAME=exec:COMMAND``: how to tell a service is ready."""
    name, check = _pair(text)
    kind, _, value = check.partition(":")
    try:
        if kind == "tcp":
            return name, {"tcp": int(value)}
        if kind == "http":
            port, slash, path = value.partition("/")
            return name, {"http": {"port": int(port), "path": slash + path or "/"}}
    except ValueError:
        pass
    else:
        if kind == "exec" and value.strip():
            return name, {"exec": value}
    raise argparse.ArgumentTypeError(f"expected NAME=tcp:PORT, NAME=http:PORT/PATH or NAME=exec:COMMAND, got {text!r}")


def _seconds(text: str) -> tuple[str, float]:
    name, value = _pair(text)
    try:
        return name, float(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected NAME=SECONDS, got {text!r}") from error


def _time(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 time (2026-01-31 or 2026-01-31T12:00:00+00:00), got {text!r}"
        ) from error


def _octal(text: str) -> int:
    try:
        return int(text, 8)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected an octal mode such as 644, got {text!r}") from error


# --- the parser ------------------------------------------------------------------------


def _add_selection(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--label", metavar="KEY:VALUE", help=f"{verb} every live sandbox with this label")
    parser.add_argument("--launch", metavar="LAUNCH_ID", help=f"{verb} every live sandbox of this launch")


def _one_target(args: argparse.Namespace) -> str | None:
    """What is wrong with an exec's targets (a usage error), if anything."""
    if args.label and args.launch:
        return "give --label or --launch, not both"
    if not (args.sandbox or args.label or args.launch):
        return "give a SANDBOX, or --label KEY:VALUE or --launch ID"
    return None


def _one_selection(args: argparse.Namespace) -> str | None:
    """What is wrong with a kill's targets (a usage error), if anything."""
    given = [name for name in ("sandboxes", "label", "launch") if getattr(args, name)]
    if len(given) != 1:
        return "give SANDBOX ids, or --label KEY:VALUE, or --launch ID (one of them)"
    return None


def _add_create_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--template", default="base", help="template to start from (default: base)")
    parser.add_argument("--snapshot", help="snapshot id to fork instead of a template")
    parser.add_argument("--size", default="tiny", help="tiny, default, or another size on the rate card (default: tiny)")
    parser.add_argument("--cpu", type=float, help="explicit vCPUs (with --memory-mib, instead of --size)")
    parser.add_argument("--memory-mib", type=int, help="explicit memory in MiB (with --cpu)")
    parser.add_argument("--disk-mib", type=int, help="its disk in MiB, instead of its size's (tiny 1 GiB, default 10 GiB)")
    parser.add_argument("--ttl", type=int, default=3600, help="seconds it lives once ready (default: 3600)")
    parser.add_argument("--label", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--env", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--network-policy", metavar="POLICY_ID")
    parser.add_argument("--idempotency-key", help="a retry with the same key creates nothing new")
    parser.add_argument(
        "--idle-timeout", type=int, metavar="SECONDS", help="destroyed after this many seconds without an exec or a file call"
    )


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
        sub.set_defaults(handler=handler, parser=sub)
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

    sub = command("kill", kill, "destroy sandboxes: by id, or every one with a label or of a launch")
    sub.add_argument("sandboxes", nargs="*", metavar="SANDBOX")
    _add_selection(sub, "destroy")
    sub.add_argument("--no-wait", action="store_true", help="answer at once, not once they are gone (by id)")
    sub.set_defaults(problem=_one_selection)

    sub = command("update", update, "move a sandbox's expiry, set its idle timeout or its labels")
    sub.add_argument("sandbox")
    expiry = sub.add_mutually_exclusive_group()
    expiry.add_argument("--ttl", type=int, metavar="SECONDS", help="expires this many seconds from now")
    expiry.add_argument("--expires-at", type=_time, metavar="TIME", help="expires then (ISO 8601, with its zone)")
    sub.add_argument("--idle-timeout", type=int, metavar="SECONDS", help="destroyed after this long without a call (0: never)")
    sub.add_argument("--label", type=_pair, action="append", default=[], metavar="KEY=VALUE", help="replaces every label")

    sub = command("metrics", metrics, "what the kernel reports about a sandbox, or a launch's sandboxes summed")
    sub.add_argument("sandbox", nargs="?")
    sub.add_argument("--launch", metavar="LAUNCH_ID", help="a launch's running members, summed")
    sub.set_defaults(problem=lambda args: None if bool(args.sandbox) != bool(args.launch) else "give a SANDBOX or --launch ID")

    for name, handler, summary in (
        ("pause", pause, "freeze every process in sandboxes (billed at the paused rate)"),
        ("resume", resume, "resume paused sandboxes"),
    ):
        command(name, handler, summary).add_argument("sandboxes", nargs="+", metavar="SANDBOX")

    sub = command("snapshot", snapshot, "save a sandbox's files as a snapshot to fork from")
    sub.add_argument("sandbox")
    sub.add_argument("--name", required=True, help="for people (1-100 characters); forks name the snapshot's id")
    sub.add_argument("--label", type=_pair, action="append", default=[], metavar="KEY=VALUE")
    sub.add_argument(
        "--service",
        type=_pair,
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a process every fork starts (under /bin/sh -c); give each one a --ready",
    )
    sub.add_argument(
        "--ready",
        type=_ready,
        action="append",
        default=[],
        metavar="NAME=CHECK",
        help="when service NAME is ready: tcp:PORT, http:PORT/PATH or exec:COMMAND",
    )
    sub.add_argument(
        "--ready-timeout",
        type=_seconds,
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a fork fails if service NAME is not ready by then (default: 30)",
    )
    sub.add_argument("--idempotency-key", help="a retry with the same key takes no second snapshot")
    sub.add_argument("--no-wait", action="store_true", help="answer once it is being taken, not once it is ready")
    sub.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for it to be ready (default: 600)")
    sub.add_argument("-q", "--quiet", action="store_true", help="print only the snapshot's id")

    sub = command("snapshots", snapshots, "list, show, delete or import snapshots")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[common])
    listing.add_argument("--state", help="creating, ready or failed")
    listing.add_argument("--label", help="KEY=VALUE or KEY")
    listing.add_argument("--limit", type=int, default=100)
    actions.add_parser("get", parents=[common]).add_argument("snapshot")
    actions.add_parser("delete", parents=[common]).add_argument("snapshot")
    imported = actions.add_parser("import", parents=[common], help="an image archive as a snapshot")
    imported.add_argument("archive", help="podman save --format oci-archive, docker save, or a root filesystem's tarball")
    imported.add_argument("--name", required=True, help="for people; forks and builds name the snapshot's id")
    imported.add_argument("--kind", choices=("auto", "oci", "tar"), default="auto")
    imported.add_argument("--user", help="whom its commands run as by default (else the image's User, else root)")

    sub = command("exec", exec_command, "run a command in a sandbox (exits with its exit code), or in many (--label, --launch)")
    _add_selection(sub, "run it in")
    sub.set_defaults(problem=_one_target)
    sub.add_argument("--cwd")
    sub.add_argument("--user", help="run as this user (a name or uid of the sandbox's own /etc/passwd); root if not given")
    sub.add_argument("--env", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    sub.add_argument("--timeout", type=float, default=60.0, help="seconds before it is killed (exit 124)")
    sub.add_argument("--stdin", action="store_true", help="pass this command's standard input on")
    sub.add_argument("--stream", action="store_true", help="print the output as it comes")
    sub.add_argument(
        "--max-output",
        type=int,
        default=16 << 20,
        metavar="BYTES",
        help="keep at most this much of stdout and of stderr (default: 16 MiB; the server allows 64 MiB)",
    )
    sub.add_argument("sandbox", nargs="?", help="the sandbox (none with --label or --launch)")
    sub.add_argument("command", nargs=argparse.REMAINDER, help="one word runs under /bin/sh -c; several are argv")

    sub = command("launch", launch, "launch many sandboxes at once (--snapshot ID forks a snapshot)")
    _add_create_options(sub)
    sub.add_argument("--count", type=int, required=True)
    sub.add_argument("--wait", action="store_true", help="wait until every sandbox runs or failed (exit 1 if any failed)")
    sub.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds")
    sub.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="draw a progress bar on stderr (default: when it is a terminal)",
    )

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

    sub = command("templates", templates, "list templates, or show or delete one")
    sub.add_argument("name", nargs="?")
    sub.add_argument("--delete", action="store_true", help="delete the team's template NAME")

    sub = command("build", build, "build a template from a spec file, showing each step")
    sub.add_argument("spec", help='a JSON file: {"name", "base", "steps": [{"apt": [...]}, {"run": "..."}], "services"}')
    sub.add_argument("--name", help="the template's name (else the spec's)")
    sub.add_argument("--description")
    sub.add_argument("--logs", action="store_true", help="print the build's output as it comes (on stderr)")

    sub = command("usage", usage, "sandbox-seconds and cost")
    sub.add_argument("--start", type=_time)
    sub.add_argument("--end", type=_time)
    sub.add_argument("--group-by", default="size", help="size, key, day, all or label:KEY")

    sub = command("files", files, "read, write, list, stat, rename, watch or remove files in a sandbox; copy directories")
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
    described = actions.add_parser("stat", parents=[common], help="describe an entry (exit 1 if there is none)")
    described.add_argument("sandbox")
    described.add_argument("path")
    made = actions.add_parser("mkdir", parents=[common], help="make a directory and its parents")
    made.add_argument("sandbox")
    made.add_argument("path")
    renamed = actions.add_parser("mv", parents=[common], help="rename a file or directory")
    renamed.add_argument("sandbox")
    renamed.add_argument("path")
    renamed.add_argument("target")
    renamed.add_argument("-f", "--replace", action="store_true", help="replace what is at the target")
    watched = actions.add_parser("watch", parents=[common], help="print a directory's changes as they come (JSON lines)")
    watched.add_argument("sandbox")
    watched.add_argument("path", nargs="?", default="/")
    watched.add_argument("--timeout", type=float, help="stop after this many seconds")
    uploaded = actions.add_parser("upload-dir", parents=[common], help="copy a local directory's contents into the sandbox")
    uploaded.add_argument("sandbox")
    uploaded.add_argument("local")
    uploaded.add_argument("remote")
    downloaded = actions.add_parser("download-dir", parents=[common], help="copy a sandbox's directory to a local one")
    downloaded.add_argument("sandbox")
    downloaded.add_argument("remote")
    downloaded.add_argument("local")

    sub = command("processes", processes, "start commands without waiting; list, read, signal or wait for them")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    start = actions.add_parser("start", parents=[common], help="start a command; prints its pid")
    start.add_argument("sandbox")
    start.add_argument("--cwd")
    start.add_argument("--env", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    start.add_argument("--timeout", type=float, help="seconds before it and what it started are killed (default: none)")
    start.add_argument("--pty", metavar="ROWSxCOLS", help="run it on a terminal of this size")
    start.add_argument("command", nargs=argparse.REMAINDER, help="one word runs under /bin/sh -c; several are argv")
    actions.add_parser("list", parents=[common], help="its processes, running or not yet waited for").add_argument("sandbox")
    logs = actions.add_parser("logs", parents=[common], help="print its output so far (what is still kept)")
    logs.add_argument("sandbox")
    logs.add_argument("pid", type=int)
    logs.add_argument("-f", "--follow", action="store_true", help="then print what comes, until it exits")
    signal = actions.add_parser("signal", parents=[common], help="send it a signal (TERM unless named)")
    signal.add_argument("sandbox")
    signal.add_argument("pid", type=int)
    signal.add_argument("-s", "--signal", default="TERM", help="a name (TERM, INT, KILL, ...) or a number")
    signal.add_argument("--group", action="store_true", help="to its whole process group")
    wait = actions.add_parser("wait", parents=[common], help="print its output and exit with its exit code once it ends")
    wait.add_argument("sandbox")
    wait.add_argument("pid", type=int)
    wait.add_argument("--timeout", type=float, help="give up after this many seconds (exit 124)")

    sub = command("ports", ports, "a sandbox's ports at preview URLs: expose, list, close, wait")
    actions = sub.add_subparsers(dest="action", required=True, metavar="ACTION")
    exposed = actions.add_parser("expose", parents=[common], help="reach a port at a URL; prints the URL")
    exposed.add_argument("sandbox")
    exposed.add_argument("port", type=int)
    exposed.add_argument("--auth", choices=["key", "token", "public"], default="key", help="who may reach it (default: key)")
    exposed.add_argument("--token-ttl", type=int, metavar="SECONDS", help="with --auth token: how long the signed URL works")
    actions.add_parser("list", parents=[common], help="its exposed ports").add_argument("sandbox")
    closed = actions.add_parser("close", parents=[common], help="its URL answers 404 from now on")
    closed.add_argument("sandbox")
    closed.add_argument("port", type=int)
    forwarded = actions.add_parser("forward", parents=[common], help="relay a local port to the sandbox's port until Ctrl-C")
    forwarded.add_argument("sandbox")
    forwarded.add_argument("port", type=int)
    forwarded.add_argument("--local", type=int, default=0, metavar="N", help="the local port (default: a free one, printed)")
    waited = actions.add_parser("wait", parents=[common], help="until something listens on the port (exit 1 if not in time)")
    waited.add_argument("sandbox")
    waited.add_argument("port", type=int)
    waited.add_argument("--timeout", type=float, default=30.0, help="seconds (default: 30)")

    command("whoami", whoami, "the key, its team and its limits")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = getattr(args, "problem", None)
    if problem is not None and (message := problem(args)):
        args.parser.error(message)  # exits 2, with the command's usage
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
