"""Snapshots: a sandbox's changes become a layer, and the layer a template.

Taking one, in the order the code runs it:

1. Check: the sandbox runs (or is paused); the name is free, or already
   names this sandbox's snapshot (a replay answers with it).
2. Copy the sandbox's writable layer (init's fd 5) into a new directory
   under the layers directory *while the sandbox runs*: the long part.
   Owners are shifted from the sandbox's own uid range back to the layers'
   range, so that a fork on any range sees them as the sandbox did.  A
   pass copies only what changed since the one before; passes repeat (up to
   three) until one finds under a MiB to copy.
3. Freeze the sandbox (unless it was paused already) and copy again: only
   what changed since step 2 (:class:`layers.LayerCopy`).  Thaw.  The pause
   is this last pass, whatever the size of the changes.
4. Name the layer by its content (sha256 of its canonical listing); if that
   layer exists already, keep the existing one.
5. If the stack of snapshot layers above the template is deeper than
   ``FLATTEN_AT``, merge them into one layer (overlay's rules: whiteouts and
   opaque directories kept), so that forks mount few layers.
6. Record it as a template of kind "snapshot": layers (the new one above
   its parent's), parent, services (the parent's, then these: a name given
   again replaces the parent's), sizes.

A crash anywhere leaves either no record (a half-copied ``.incoming-*``
directory, removed at the next start) or a complete one; a sandbox left
frozen by a crash between 3's freeze and thaw is thawed by recovery, which
knows a running sandbox is never frozen.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import IO, Any, Protocol

from . import faults, fork_services, layers, users
from .cgroups import Cgroups
from .config import EngineConfig
from .errors import InvalidRequest, SandboxNotRunning, TemplateExists, TemplateNotFound
from .execution import validate_directory, validate_env
from .recovery import init_alive
from .store import SandboxRecord, Store, TemplateRecord
from .template_store import TemplateStore, layer_directory_name, validate_name
from .trees import IdShift

FLATTEN_AT = 4  # snapshot layers above the template before they are merged into one
RUNNING_PASSES = 3  # copies while the sandbox runs, at most
SETTLED_BYTES = 1 << 20  # a running pass that copied less than this: freeze now
Progress = Callable[[dict[str, Any]], None]


class SnapshotSource(Protocol):
    """What taking and moving snapshots needs of the engine (``engine.Engine`` is
    one).  A protocol rather than the engine itself, so that the engine imports
    this module and not the other way round."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def store(self) -> Store: ...

    @property
    def templates(self) -> TemplateStore: ...

    @property
    def cgroups(self) -> Cgroups: ...

    @property
    def shift(self) -> IdShift: ...

    def sandbox_shift(self, record: SandboxRecord) -> IdShift: ...

    def find(self, sandbox_id: Any) -> SandboxRecord: ...

    def exclusive(self, sandbox_id: str) -> AbstractAsyncContextManager[None]: ...


def merged_services(parent: list[dict[str, Any]], added: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = {service["name"] for service in added}
    return [service for service in parent if service["name"] not in names] + added


class Snapshots:
    def __init__(self, engine: SnapshotSource) -> None:
        self.engine = engine
        self.config = engine.config

    def _incoming(self) -> Path:
        self.config.layers_dir.mkdir(parents=True, exist_ok=True)
        directory = self.config.layers_dir / f".incoming-{uuid.uuid4().hex[:12]}"
        directory.mkdir(mode=0o755)
        return directory

    def _adopt_layer(self, incoming: Path, layer_id: str, summary: dict[str, Any]) -> None:
        """Move a finished layer to its content address (or drop it: the same layer is there)."""
        final = self.engine.templates.layer_path(layer_id)
        if final.exists():
            shutil.rmtree(incoming)
        else:
            os.rename(incoming, final)
        self.engine.store.put_layer(layer_id, {"id": layer_id, "created_at": time.time(), **summary})

    async def take(self, args: dict[str, Any], progress: Progress) -> TemplateRecord:
        engine = self.engine
        name = validate_name(args.get("name"))
        added = fork_services.validate(args.get("services"))
        defaults = _defaults(args.get("defaults"))
        record = engine.find(args.get("sandbox"))
        source = f"sandbox:{record.id}"
        existing = next((template for template in engine.templates.list() if template.name == name), None)
        if existing is not None:
            if existing.kind == "snapshot" and existing.source == source:
                return existing  # a replay
            raise TemplateExists(f"a template or snapshot named {name!r} exists", template=name)
        if record.state not in ("running", "paused"):
            raise SandboxNotRunning(
                f"sandbox {record.id} is {record.state}: only a live sandbox can be snapshotted", sandbox=record.id
            )
        try:
            parent = engine.templates.get(record.template)
        except TemplateNotFound:
            raise InvalidRequest(
                f"sandbox {record.id} was made from {record.template!r}, which is gone: its layers cannot be named",
                field="sandbox",
            ) from None
        # A create or destroy in flight finishes first; a destroy or another
        # snapshot waits for this one.
        async with engine.exclusive(record.id):
            return await self._take(record, name, parent, merged_services(parent.services, added), source, progress, defaults)

    async def _take(
        self,
        record: SandboxRecord,
        name: str,
        parent: TemplateRecord,
        wanted: list[dict[str, Any]],
        source: str,
        progress: Progress,
        defaults: dict[str, Any],
    ) -> TemplateRecord:
        engine = self.engine
        proc = str(self.config.proc_dir)
        try:
            upper = os.open(f"{proc}/{record.pid}/fd/5", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as error:
            raise SandboxNotRunning(f"sandbox {record.id} is not running", sandbox=record.id) from error
        incoming = self._incoming()
        try:
            if not init_alive(record, proc):  # the pid named someone else when we opened it
                raise SandboxNotRunning(f"sandbox {record.id} is not running", sandbox=record.id)
            dest = os.open(incoming, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # Owners come out of the sandbox's own range, into the layers'.
                copy = layers.LayerCopy(engine.shift, max(record.disk_bytes, 1), progress, engine.sandbox_shift(record))
                progress({"phase": "copy", "sandbox": record.id})
                # Copy while it runs until a pass finds little left to copy:
                # what a pass copies was changing during the one before.
                copied_bytes = 0
                for _ in range(RUNNING_PASSES):
                    done = await asyncio.to_thread(copy.sync, upper, dest)
                    copied_bytes += done.copied_bytes
                    if done.copied_bytes < SETTLED_BYTES:
                        break
                faults.reached("snapshot:copied")
                frozen_here = record.state == "running"
                freeze_started = time.monotonic()
                if frozen_here:
                    await asyncio.to_thread(engine.cgroups.freeze, record.cgroup, True)
                try:
                    faults.reached("snapshot:frozen")
                    second = await asyncio.to_thread(copy.sync, upper, dest)
                finally:
                    if frozen_here:
                        await asyncio.to_thread(engine.cgroups.freeze, record.cgroup, False)
                paused_ms = (time.monotonic() - freeze_started) * 1000 if frozen_here else 0.0
                progress(
                    {
                        "phase": "paused",
                        "paused_ms": round(paused_ms, 3),
                        "copied_bytes": copied_bytes,
                        "recopied_bytes": second.copied_bytes,
                    }
                )
                layer_id = copy.digest()
            finally:
                os.close(dest)
            self._adopt_layer(incoming, layer_id, {"size_bytes": copy.total_bytes, "files": copy.files, "source": source})
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        finally:
            os.close(upper)
        faults.reached("snapshot:layer")
        # The same layer twice in one stack is refused by overlayfs ("conflicting lowerdir path"): two
        # snapshots in a row that changed nothing both have the empty layer. The upper copy shadows all of
        # the lower one's files, so dropping the lower one changes nothing a fork sees.
        stack = [layer_id, *(layer for layer in parent.layers if layer != layer_id)]
        if len(stack) - 1 > FLATTEN_AT:
            progress({"phase": "flatten", "layers": len(stack) - 1})
            stack = [await asyncio.to_thread(self._flatten, stack[:-1]), stack[-1]]
        snapshot = TemplateRecord(
            name=name,
            layers=stack,
            env={**parent.env, **defaults.get("env", {})},
            workdir=defaults.get("workdir") or parent.workdir,
            user=defaults["user"] if "user" in defaults else parent.user,
            source=source,
            size_bytes=copy.total_bytes,
            created_at=time.time(),
            kind="snapshot",
            parent=parent.name,
            services=wanted,
            total_bytes=copy.total_bytes + (parent.total_bytes or parent.size_bytes),
            files=copy.files,
            paused_ms=round(paused_ms, 3),
        )
        engine.templates.put(snapshot)
        progress({"phase": "done", "layer": layer_id, "size_bytes": snapshot.size_bytes})
        return snapshot

    def _flatten(self, stack: list[str]) -> str:
        """Merge snapshot layers (topmost first) into one; its content address."""
        incoming = self._incoming()
        try:
            dest = os.open(incoming, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for layer_id in reversed(stack):
                    source = os.open(self.engine.templates.layer_path(layer_id), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        layers.merge_into(source, dest, self.engine.shift, 1 << 62)
                    finally:
                        os.close(source)
                summary = layers.tree_digest(dest, self.engine.shift)
            finally:
                os.close(dest)
            self._adopt_layer(
                incoming, summary.digest, {"size_bytes": summary.total_bytes, "files": summary.entries, "merged": stack}
            )
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        return summary.digest

    # --- moving a snapshot between hosts ---------------------------------------------------

    def export_stream(self, name: Any, have: Any) -> Iterator[bytes]:
        """One PAX tar: ``record.json`` (the record, and which layers follow), then
        the entries of each layer the receiver lacks, under ``<layer dir>/``."""
        record = self.engine.templates.get(validate_name(name))
        if record.kind != "snapshot":
            raise InvalidRequest(f"{name!r} is a template, not a snapshot: import templates on each host", field="name")
        if not isinstance(have, list) or not all(isinstance(layer, str) for layer in have):
            raise InvalidRequest("have is a list of layer ids", field="have")
        wanted = [layer for layer in record.layers if layer not in set(have)]
        for layer_id in wanted:
            if not self.engine.templates.layer_path(layer_id).is_dir():
                raise TemplateNotFound(f"layer {layer_id} of {name!r} is missing on this host", template=name)

        def chunks() -> Iterator[bytes]:
            spool = layers.Spool()
            archive = tarfile.open(
                fileobj=spool, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape"
            )  # type: ignore[call-overload]
            body = json.dumps({"record": vars(record), "layers": wanted}).encode()
            member = tarfile.TarInfo("record.json")
            member.size = len(body)
            archive.addfile(member, io.BytesIO(body))
            yield from spool.take()
            for layer_id in wanted:
                fd = os.open(self.engine.templates.layer_path(layer_id), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    yield from layers.add_layer(archive, spool, fd, self.engine.shift, layer_directory_name(layer_id) + "/")
                finally:
                    os.close(fd)
            archive.close()
            yield from spool.take()

        return chunks()

    def import_stream(self, stream: IO[bytes]) -> TemplateRecord:
        """Take :meth:`export_stream`'s output: every layer checked against its
        content address before it is kept, then the record."""
        engine = self.engine
        made: dict[str, tuple[str, Path, int, layers.LayerExtractor]] = {}
        try:
            with tarfile.open(fileobj=stream, mode="r|", encoding="utf-8", errors="surrogateescape") as archive:
                head = archive.next()
                if head is None or head.name != "record.json" or not head.isfile() or head.size > 1 << 20:
                    raise InvalidRequest("a snapshot archive starts with record.json", field="body")
                raw = archive.extractfile(head)
                assert raw is not None
                try:
                    manifest = json.loads(raw.read())
                    record = TemplateRecord(**manifest["record"])
                    incoming_layers = [str(layer) for layer in manifest["layers"]]
                except (ValueError, TypeError, KeyError) as error:
                    raise InvalidRequest(f"record.json is not a snapshot record: {error}", field="body") from None
                validate_name(record.name)
                if record.kind != "snapshot" or not set(incoming_layers) <= set(record.layers):
                    raise InvalidRequest("record.json is not a snapshot record", field="body")
                for layer_id in incoming_layers:
                    directory = self._incoming()
                    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    made[layer_directory_name(layer_id)] = (layer_id, directory, fd, layers.LayerExtractor(fd, engine.shift))
                for member in archive:
                    if member is head:
                        continue  # iterating a stream starts with the members already read
                    top, _, rest = member.name.partition("/")
                    if top not in made or not rest:
                        raise InvalidRequest(
                            f"snapshot archive entry {member.name!r} belongs to no layer it announced", field="body"
                        )
                    made[top][3].add(archive, member, rest)
            summaries = {}
            for layer_id, _directory, fd, extractor in made.values():
                extractor.finish()
                summary = layers.tree_digest(fd, engine.shift)
                if summary.digest != layer_id:
                    raise InvalidRequest(f"layer {layer_id} arrived with different content ({summary.digest})", field="body")
                summaries[layer_id] = summary
            for layer_id, directory, _, _ in made.values():
                summary = summaries[layer_id]
                self._adopt_layer(
                    directory, layer_id, {"size_bytes": summary.total_bytes, "files": summary.entries, "source": "import"}
                )
        except tarfile.TarError as error:
            raise InvalidRequest(f"not a snapshot archive: {error}", field="body") from None
        finally:
            for _, directory, fd, _ in made.values():
                os.close(fd)
                shutil.rmtree(directory, ignore_errors=True)  # gone already if adopted
        missing = [layer for layer in record.layers if not engine.templates.layer_path(layer).is_dir()]
        if missing:
            raise InvalidRequest(f"the archive lacks layers this host does not have: {', '.join(missing)}", field="body")
        engine.templates.put(record)
        return record


def _defaults(raw: Any) -> dict[str, Any]:
    """What a snapshot changes of its forks' defaults (a template build's ``env``, ``workdir``, ``user``
    steps): ``env`` is added to the parent's, the others replace it."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or set(raw) - {"env", "workdir", "user"}:
        raise InvalidRequest("defaults takes env, workdir and user only", field="defaults")
    defaults: dict[str, Any] = {}
    if "env" in raw:
        defaults["env"] = validate_env(raw["env"], "defaults.env")
    if "workdir" in raw:
        defaults["workdir"] = validate_directory(raw["workdir"], "defaults.workdir")
    if "user" in raw:
        defaults["user"] = users.validate(raw["user"]) or ""
    return defaults
