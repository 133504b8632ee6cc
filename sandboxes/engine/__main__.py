"""``forkyard-engine``: run the per-host engine and administer it.

forkyard-engine serve                       run the daemon (as root)
forkyard-engine info                        what the running engine reports
forkyard-engine preflight [--raise]         the host's limits for max_sandboxes (offline)
forkyard-engine template build-base         the busybox 'base' template
forkyard-engine template build-debian       a Debian template, "debian" (debootstrap; builds name it debian:bookworm)
forkyard-engine template import NAME SRC    from a directory, tarball or OCI image
forkyard-engine template list
forkyard-engine run [--template T] -- CMD   create, exec, destroy (a smoke test)
forkyard-engine reclaim                     offline: reap every sandbox and leftover
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import uvloop

from . import preflight
from .client import EngineClient
from .config import EngineConfig
from .errors import EngineError


def _serve(config: EngineConfig) -> int:
    from . import data_tokens
    from .engine import Engine
    from .gateway import Gateway
    from .server import EngineServer

    async def main() -> None:
        engine = Engine(config)
        report = await engine.start()
        gateway = None
        if config.gateway:
            gateway = Gateway(engine, data_tokens.host_secret(config.gateway_secret_path), config.gateway_revoked_path)
            url = await gateway.listen(config.gateway, config.gateway_url)
            logging.getLogger("forkyard.engine").info("data path gateway on %s", url)
        server = EngineServer(engine, gateway)
        await server.listen()
        if config.listen:
            await server.listen_tcp(config.listen, config.token)
            logging.getLogger("forkyard.engine").info("also listening on tcp %s (token required)", config.listen)
        logging.getLogger("forkyard.engine").info(
            "listening on %s (recovery: adopted %s, reaped %s, cgroups removed %s)",
            config.socket_path,
            report.adopted,
            report.reaped,
            report.cgroups_removed,
        )
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signal_number, stopping.set)
        await stopping.wait()
        await server.close()
        if gateway is not None:
            await gateway.close()
        await engine.stop()

    if os.geteuid() != 0:
        print("forkyard-engine serve must run as root (it creates namespaces, mounts and cgroups)", file=sys.stderr)
        return 2
    if config.event_loop == "uvloop":
        # libuv's loop: about a fifth less of the engine's CPU per exec than asyncio's (bench/api_bench.py).
        uvloop.run(main())
    else:
        asyncio.run(main())
    return 0


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def _template(args: argparse.Namespace, config: EngineConfig) -> int:
    client = EngineClient(config.socket_path)

    def progress(event: dict[str, Any]) -> None:
        print("  " + " ".join(f"{key}={value}" for key, value in event.items() if key != "event"), file=sys.stderr)

    if args.template_command == "list":
        _print(client.call("templates.list"))
    elif args.template_command == "build-base":
        _print(client.call("templates.build_base", name=args.name, replace=True))
    elif args.template_command == "build-debian":
        from .template_store import build_debian_rootfs

        staging = config.state_dir / "staging" / args.name
        print(f"debootstrap {args.suite} into {staging} (a few minutes)...", file=sys.stderr)
        build_debian_rootfs(staging, args.suite, tuple(args.include.split(",")))
        try:
            _print(client.import_template(args.name, str(staging), "directory", replace=True, on_progress=progress))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    elif args.template_command == "import":
        source = str(Path(args.source).resolve())
        _print(client.import_template(args.name, source, args.kind, replace=args.replace, on_progress=progress, user=args.user))
    return 0


def _run(args: argparse.Namespace, config: EngineConfig) -> int:
    client = EngineClient(config.socket_path)
    sandbox = client.create(template=args.template, size=args.size, ttl_s=60)
    try:
        result = client.exec(sandbox["id"], args.argv if len(args.argv) > 1 else args.argv[0])
        sys.stdout.buffer.write(result.stdout)
        sys.stderr.buffer.write(result.stderr)
        return result.exit_code
    finally:
        client.destroy(sandbox["id"])


def _reclaim(config: EngineConfig) -> int:
    from .cgroups import detect
    from .recovery import reconcile
    from .store import open_store

    store = open_store(config.database_path)
    report, _ = reconcile(config, store, detect(config), adopt=False)
    _print(report.to_dict())
    return 0


def _preflight(args: argparse.Namespace, config: EngineConfig) -> int:
    """The host's limits against what max_sandboxes needs, without a running engine; raised with --raise."""
    if args.max_sandboxes:
        config = dataclasses.replace(config, max_sandboxes=args.max_sandboxes)
    report = preflight.check(config, networks=args.networks)
    if args.raise_limits:
        report = preflight.raise_short(report, config)
    if args.json:
        _print(report.to_dict())
    else:
        print(f"{'':8} {'limit':36} {'value':>12} {'needs':>12} {'fits':>9}")
        for finding in report.findings:
            fits = f"{finding.fits:,}" if finding.caps else "-"  # the others bound what sandboxes do, not how many
            need = f"{finding.need:,} each" if finding.per_user else f"{finding.need:,}"  # per sandbox: its own user
            print(f"{finding.status:8} {finding.name:36} {finding.value:>12,} {need:>12} {fits:>9}")
        print(f"\n{report.fits:,} of max_sandboxes {config.max_sandboxes:,} fit (bound by {report.limiting})")
        for how in report.to_dict()["to_set"]:
            print(f"  to set: {how}")
    return 1 if report.short else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="forkyard-engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--state-dir", type=Path, help="default /var/lib/forkyard")
    parser.add_argument("--run-dir", type=Path, help="default /run/forkyard")
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve")
    commands.add_parser("info")
    checked = commands.add_parser("preflight", help="the host's kernel limits against what max_sandboxes needs")
    checked.add_argument("--raise", dest="raise_limits", action="store_true", help="raise what is short (as root)")
    checked.add_argument("--max-sandboxes", type=int, default=0, help="default: the engine's configuration")
    checked.add_argument("--networks", action="store_true", help="also the limits sandboxes with networks need")
    checked.add_argument("--json", action="store_true")
    commands.add_parser("reclaim")
    template = commands.add_parser("template")
    template_commands = template.add_subparsers(dest="template_command", required=True)
    template_commands.add_parser("list")
    base = template_commands.add_parser("build-base")
    base.add_argument("--name", default="base")
    debian = template_commands.add_parser("build-debian")
    debian.add_argument("--name", default="debian")
    debian.add_argument("--suite", default="bookworm")
    debian.add_argument("--include", default="python3")
    imported = template_commands.add_parser("import")
    imported.add_argument("name")
    imported.add_argument("source")
    imported.add_argument("--kind", default="auto", choices=("auto", "directory", "tar", "oci"))
    imported.add_argument("--replace", action="store_true")
    imported.add_argument(
        "--user", help="whom its commands run as when an exec names none (default: an OCI image's User, else root)"
    )
    run = commands.add_parser("run")
    run.add_argument("--template", default="base")
    run.add_argument("--size", default="tiny")
    run.add_argument("argv", nargs="+")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    overrides = {key: value for key, value in (("state_dir", args.state_dir), ("run_dir", args.run_dir)) if value}
    try:
        config = EngineConfig.from_environment(**overrides)
    except ValueError as error:  # a FORKYARD_ENGINE_* setting that is not what it must be
        parser.error(str(error))
    try:
        if args.command == "serve":
            return _serve(config)
        if args.command == "info":
            _print(EngineClient(config.socket_path).info())
            return 0
        if args.command == "preflight":
            return _preflight(args, config)
        if args.command == "reclaim":
            return _reclaim(config)
        if args.command == "template":
            return _template(args, config)
        if args.command == "run":
            return _run(args, config)
    except EngineError as error:
        print(f"error [{error.code}]: {error.message}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
