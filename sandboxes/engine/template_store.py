"""Templates: read-only root filesystems, stored as layers.

A layer is a directory under ``<state>/layers`` whose name is the start of its
content digest; a template is an ordered list of layers (topmost first) plus
the environment and working directory its image asks for.  Ownership in a
layer is already shifted into the layers' uid range (``uid_base``): every
sandbox sees it through idmapped mounts shifted into its own range, so the
overlay shows ``root`` as root inside every sandbox and no layer is copied.

Import, in the order the code runs it:

1. Unpack into a fresh ``.incoming-*`` directory: from a host directory (walked
   as a tar stream), a tarball, or an OCI image (an image-layout directory or
   a ``docker save``/``podman save`` tarball: each image layer's whiteouts
   are applied to what is below it, then its files are unpacked, so the image
   flattens to one layer).  Everything goes through :class:`trees.Tree`: an
   image cannot write outside the directory, whatever its paths or links say.
2. Make sure ``/proc``, ``/sys``, ``/dev``, ``/tmp`` and ``/root`` are plain
   directories (sandbox creation refuses anything else).  An
   ``/etc/resolv.conf`` (often the build host's copy) is replaced by one
   that names no resolver: a sandbox reaches none but the one its network
   policy gives it, which the engine writes there.
3. Digest the tree (a deterministic tar stream of it) to name the layer.
4. Rename into place (a layer that already exists is reused), record it.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from . import users
from .config import EngineConfig
from .errors import EngineError, InvalidRequest, TemplateExists, TemplateImportFailed, TemplateNotFound
from .layers import tree_digest
from .store import Store, TemplateRecord
from .trees import IdShift, Tree

NAME_ALPHABET = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")
REQUIRED_DIRECTORIES = {"proc": 0o555, "sys": 0o555, "dev": 0o755, "tmp": 0o1777, "root": 0o700}
# What a template's /etc/resolv.conf becomes at import.  No nameserver: a lookup goes to the
# sandbox's own loopback, where nothing answers, and fails at once.
RESOLV_CONF = (
    b"# No resolver: a sandbox without a network policy has loopback only.\n"
    b"# Under a policy, forkyard writes the sandbox's own resolver here.\n"
)
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
Progress = Callable[[dict[str, Any]], None]


def validate_name(name: Any) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not set(name) <= NAME_ALPHABET or name[0] in "-.":
        raise InvalidRequest("template name must be 1-64 characters of a-z, 0-9, '-', '_' and '.'", field="name")
    return name


class _ChunkReader(io.RawIOBase):
    """A file object over an iterator of byte chunks (a tar stream in flight)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks = chunks
        self.pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            try:
                self.pending = next(self.chunks)
            except StopIteration:
                return 0
        count = min(len(buffer), len(self.pending))
        buffer[:count] = self.pending[:count]
        self.pending = self.pending[count:]
        return count


def host_tree_stream(source: Path) -> IO[bytes]:
    """A tar stream of a host directory, ids as they are on the host."""
    fd = os.open(source, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    tree = Tree(fd, IdShift(0, 1 << 32), one_mount=True)

    def chunks() -> Iterator[bytes]:
        try:
            yield from tree.tar_chunks(".")
        finally:
            os.close(fd)

    return io.BufferedReader(_ChunkReader(chunks()), buffer_size=1 << 20)


def _digest(directory: Path, shift: IdShift) -> tuple[str, int]:
    """A layer's content address, the same way snapshot layers get theirs (no
    times in it: the same image imported on two hosts is the same layer)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        summary = tree_digest(fd, shift)
    finally:
        os.close(fd)
    return summary.digest, summary.total_bytes


def layer_directory_name(layer_id: str) -> str:
    return layer_id.split(":", 1)[-1][:24]


class OciImage:
    """Reads an OCI image layout directory or a docker/podman save tarball."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.archive: tarfile.TarFile | None = None
        if source.is_file():
            try:
                self.archive = tarfile.open(source)
            except tarfile.TarError as error:
                raise TemplateImportFailed(f"{source} is not a tar archive: {error}") from None

    def _read(self, name: str) -> bytes:
        name = name.lstrip("./")
        if self.archive is None:
            path = (self.source / name).resolve()
            if not path.is_relative_to(self.source.resolve()):
                raise TemplateImportFailed(f"image refers outside itself: {name}")
            return path.read_bytes()
        try:
            member = self.archive.extractfile(name)
        except KeyError:
            member = None
        if member is None:
            raise TemplateImportFailed(f"image has no {name}")
        return member.read()

    def _open(self, name: str) -> IO[bytes]:
        name = name.lstrip("./")
        if self.archive is None:
            path = (self.source / name).resolve()
            if not path.is_relative_to(self.source.resolve()):
                raise TemplateImportFailed(f"image refers outside itself: {name}")
            return open(path, "rb")
        member = self.archive.extractfile(name)
        if member is None:
            raise TemplateImportFailed(f"image has no {name}")
        return member

    def _blob(self, digest: str) -> str:
        algorithm, _, value = digest.partition(":")
        if not value.isalnum():
            raise TemplateImportFailed(f"bad digest {digest!r}")
        return f"blobs/{algorithm}/{value}"

    def layers_and_config(self) -> tuple[list[str], dict[str, Any]]:
        """Layer file names (bottom first) and the image config."""
        names = self.archive.getnames() if self.archive else [p.name for p in self.source.iterdir()]
        try:
            if "manifest.json" in names:  # docker save / podman save
                manifest = json.loads(self._read("manifest.json"))[0]
                config = json.loads(self._read(manifest["Config"]))
                return list(manifest["Layers"]), config
            index = json.loads(self._read("index.json"))
            descriptor = index["manifests"][0]
            manifest = json.loads(self._read(self._blob(descriptor["digest"])))
            if "manifests" in manifest:  # an index of platforms: take the first
                manifest = json.loads(self._read(self._blob(manifest["manifests"][0]["digest"])))
            config = json.loads(self._read(self._blob(manifest["config"]["digest"])))
            return [self._blob(layer["digest"]) for layer in manifest["layers"]], config
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise TemplateImportFailed(f"not an OCI image layout or docker save archive: {error}") from None

    def open_layer(self, name: str) -> IO[bytes]:
        return self._open(name)


class TemplateStore:
    """This host's templates and snapshots: their records in the store, their layers on disk."""

    def __init__(self, config: EngineConfig, store: Store) -> None:
        self.config = config
        self.store = store
        self.shift = IdShift(config.uid_base, config.uid_count)
        self._referenced: set[str] | None = None

    def put(self, record: TemplateRecord) -> None:
        self.store.put_template(record)
        self._referenced = None

    def referenced_layers(self) -> set[str]:
        """Every layer some template or snapshot names (cached until one changes)."""
        if self._referenced is None:
            self._referenced = {layer for template in self.store.templates() for layer in template.layers}
        return self._referenced

    def get(self, name: str) -> TemplateRecord:
        for record in self.store.templates():
            if record.name == name:
                return record
        raise TemplateNotFound(f"no template named {name!r}", template=name)

    def list(self) -> list[TemplateRecord]:
        return list(self.store.templates())

    def layer_path(self, layer_id: str) -> Path:
        return self.config.layers_dir / layer_directory_name(layer_id)

    def delete(self, name: str, in_use: Callable[[builtins.list[str]], bool]) -> None:
        record = self.get(name)
        self.store.delete_template(name)
        self._referenced = None
        self.collect_layers(in_use)
        del record

    def collect_layers(self, in_use: Callable[[builtins.list[str]], bool]) -> int:
        """Remove layers no template (and no live sandbox) refers to."""
        referenced = self.referenced_layers()
        removed = 0
        for layer_id in self.store.layers():
            if layer_id in referenced or in_use([layer_id]):
                continue
            shutil.rmtree(self.layer_path(layer_id), ignore_errors=True)
            self.store.delete_layer(layer_id)
            removed += 1
        return removed

    def import_template(
        self,
        name: str,
        source: str,
        kind: str = "auto",
        replace: bool = False,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        progress: Progress | None = None,
        user: str | int | None = None,
        as_snapshot: bool = False,
    ) -> TemplateRecord:
        """``as_snapshot``: recorded as a snapshot of no parent (an uploaded image: the control plane's snapshot,
        forked, built on and copied to other hosts as any snapshot is)."""
        validate_name(name)
        default_user = users.validate(user)
        if not replace and any(t.name == name for t in self.store.templates()):
            raise TemplateExists(f"template {name!r} exists; pass replace to overwrite it", template=name)
        path = Path(source)
        if not path.exists():
            raise TemplateImportFailed(f"{source} does not exist on the engine's host", source=source)
        if kind == "auto":
            kind = self._guess_kind(path)
        report = progress or (lambda _event: None)
        self.config.layers_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # its modes: statedir.py
        incoming = self.config.layers_dir / f".incoming-{uuid.uuid4().hex[:12]}"
        incoming.mkdir(mode=0o755)
        os.chown(incoming, self.config.uid_base, self.config.uid_base)
        image_config: dict[str, Any] = {}
        started = time.monotonic()
        try:
            fd = os.open(incoming, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                tree = Tree(fd, self.shift)
                report({"phase": "unpack", "kind": kind, "source": source})
                if kind == "directory":
                    counts = tree.extract(host_tree_stream(path), ".")
                elif kind == "tar":
                    with open(path, "rb") as stream:
                        counts = tree.extract(stream, ".")
                elif kind == "oci":
                    counts, image_config = self._unpack_oci(tree, path, report)
                else:
                    raise InvalidRequest(f"unknown template source kind {kind!r}: use directory, tar or oci", field="kind")
                report({"phase": "unpacked", **counts})
                for directory, mode in REQUIRED_DIRECTORIES.items():
                    self._ensure_directory(tree, directory, mode)
                working = (workdir or image_config.get("config", {}).get("WorkingDir") or "/").strip("/")
                if working and isinstance(working, str):
                    # As a container runtime does: an image's working directory is made where it lacks one.
                    try:
                        tree.stat(working)
                    except Exception:  # noqa: BLE001 - absent (a dangling link stays: the exec says so)
                        tree.make_directories(working, 0o755)
                forget_resolver(tree)
                report({"phase": "digest"})
                layer_id, size = _digest(incoming, self.shift)
            finally:
                os.close(fd)
            final = self.layer_path(layer_id)
            if final.exists():
                shutil.rmtree(incoming)
            else:
                incoming.rename(final)
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        self.store.put_layer(layer_id, {"id": layer_id, "size_bytes": size, "created_at": time.time(), "source": source})
        record = TemplateRecord(
            name=name,
            layers=[layer_id],
            env={**DEFAULT_ENV, **self._image_env(image_config), **(env or {})},
            workdir=workdir or image_config.get("config", {}).get("WorkingDir") or "/",
            user=default_user or self._image_user(image_config),
            source=f"{kind}:{source}",
            size_bytes=size,
            created_at=time.time(),
        )
        if as_snapshot:
            record.kind, record.total_bytes = "snapshot", size
        self.put(record)
        report({"phase": "done", "layer": layer_id, "size_bytes": size, "seconds": round(time.monotonic() - started, 3)})
        return record

    @staticmethod
    def _image_user(image_config: dict[str, Any]) -> str:
        """An OCI image's ``User`` (``name``, ``uid``, or either with ``:group``): the user part, if valid."""
        configured = image_config.get("config", {}).get("User")
        if not isinstance(configured, str) or not configured:
            return ""
        try:
            return users.validate(configured.split(":", 1)[0]) or ""
        except InvalidRequest:
            return ""  # not a name the sandbox could hold: its commands run as root, as before

    @staticmethod
    def _guess_kind(path: Path) -> str:
        if path.is_dir():
            return "oci" if (path / "index.json").exists() and (path / "blobs").is_dir() else "directory"
        try:
            with tarfile.open(path) as archive:
                names = set()
                for member in archive:
                    names.add(member.name.lstrip("./"))
                    if len(names) > 64:
                        break
                if "manifest.json" in names or "index.json" in names or "oci-layout" in names:
                    return "oci"
        except tarfile.TarError as error:
            raise TemplateImportFailed(f"{path} is neither a directory nor a tar archive: {error}") from None
        return "tar"

    @staticmethod
    def _image_env(image_config: dict[str, Any]) -> dict[str, str]:
        env = {}
        for item in image_config.get("config", {}).get("Env") or []:
            key, _, value = str(item).partition("=")
            if key:
                env[key] = value
        return env

    def _unpack_oci(self, tree: Tree, path: Path, report: Progress) -> tuple[dict[str, Any], dict[str, Any]]:
        image = OciImage(path)
        layers, config = image.layers_and_config()
        totals: dict[str, Any] = {}
        for number, layer in enumerate(layers, 1):
            report({"phase": "layer", "layer": number, "of": len(layers)})
            # Whiteouts hide what lower layers put there, never this layer's
            # own files: apply them first, then unpack the rest.
            with image.open_layer(layer) as stream:
                whiteouts = tree.oci_whiteouts(stream)
            with image.open_layer(layer) as stream:
                counts = tree.extract(stream, ".", oci_whiteouts=True)
            counts["whiteouts"] = whiteouts
            for key, value in counts.items():
                if isinstance(value, list):
                    totals.setdefault(key, []).extend(value)
                else:
                    totals[key] = totals.get(key, 0) + value
        return totals, config

    def _ensure_directory(self, tree: Tree, relative: str, mode: int) -> None:
        try:
            info = tree.stat(relative)
        except Exception:  # noqa: BLE001 - absent, or a dangling link
            info = None
        if info is not None and info["type"] != "directory":
            tree.remove(relative, recursive=True)
            info = None
        if info is None:
            tree.make_directories(relative, mode)
            fd = tree.open(relative, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)


def forget_resolver(tree: Tree) -> bool:
    """Replace the tree's ``etc/resolv.conf``, if it has one, by :data:`RESOLV_CONF`: whatever is at
    the name (a symlink too; a directory is left alone) is removed, never written through.  Whether
    it was replaced."""
    try:
        if tree.stat("etc/resolv.conf")["type"] == "directory":
            return False
    except EngineError:
        return False  # none (or no /etc)
    tree.replace_file("etc/resolv.conf", lambda: iter([RESOLV_CONF]), 0o644, 0, 0, time.time())
    return True


# --- building the stock templates ------------------------------------------------


def _is_static(binary: Path) -> bool:
    """An ELF file with no PT_INTERP program header needs no loader."""
    import struct

    with open(binary, "rb") as handle:
        header = handle.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2:
            return False
        (phoff,) = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        handle.seek(phoff)
        table = handle.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, index * phentsize)[0] != 3 for index in range(phnum))


def build_base_rootfs(target: Path, busybox: Path = Path("/bin/busybox")) -> Path:
    """A minimal root filesystem from Debian's busybox-static: no registry needed."""
    if not busybox.exists() or not _is_static(busybox):
        raise TemplateImportFailed(f"{busybox} is missing or not static: install Debian's busybox-static package")
    if target.exists():
        shutil.rmtree(target)
    for directory in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "root", "proc", "sys", "dev", "home", "var/tmp"):
        (target / directory).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, target / "bin" / "busybox")
    listing = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, check=True).stdout
    for applet in listing.split():
        link = target / applet
        if link.name == "busybox" or link.exists():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target / "bin" / "busybox", link.parent))
    (target / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    (target / "etc" / "group").write_text("root:x:0:\ntty:x:5:\nnogroup:x:65534:\n")
    (target / "etc" / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (target / "etc" / "os-release").write_text('NAME="forkyard base"\nID=forkyard-base\nPRETTY_NAME="forkyard base (busybox)"\n')
    os.chmod(target / "tmp", 0o1777)
    os.chmod(target / "root", 0o700)
    return target


def build_debian_rootfs(
    target: Path, suite: str = "bookworm", include: tuple[str, ...] = ("python3",), mirror: str = "http://deb.debian.org/debian"
) -> Path:
    """A Debian root filesystem with Python, from Debian's own packages."""
    if shutil.which("debootstrap") is None:
        raise TemplateImportFailed("debootstrap is missing: install Debian's debootstrap package")
    if target.exists():
        shutil.rmtree(target)
    command = ["debootstrap", "--variant=minbase", f"--include={','.join(include)}", suite, str(target), mirror]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise TemplateImportFailed(f"debootstrap failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    _forget_build_host(target)
    return target


def install_debian_packages(target: Path, packages: tuple[str, ...]) -> Path:
    """Debian packages installed into a root filesystem ``build_debian_rootfs`` made, by its own apt in a
    chroot (apt resolves what debootstrap's ``--include`` cannot: virtual packages, alternatives), without
    recommends; apt's downloads and lists are removed after."""
    resolv = target / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)  # never written through a link the root filesystem holds
    shutil.copyfile("/etc/resolv.conf", resolv)
    proc = target / "proc"
    subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
    try:
        script = "apt-get update -q && apt-get install -y -q --no-install-recommends \"$@\""
        command = ["chroot", str(target), "/usr/bin/env", "DEBIAN_FRONTEND=noninteractive", "sh", "-c", script, "apt", *packages]
        result = subprocess.run(command, capture_output=True, text=True)
    finally:
        subprocess.run(["umount", str(proc)], check=False)
    if result.returncode != 0:
        raise TemplateImportFailed(f"apt-get install failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    _forget_build_host(target)
    return target


def _forget_build_host(target: Path) -> None:
    """apt's downloads and lists, and the build host's resolv.conf (a resolver no sandbox reaches), removed."""
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (target / cache).glob("*"):
            if item.is_file():
                item.unlink()
    fd = os.open(target, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        forget_resolver(Tree(fd, IdShift(0, 1 << 32)))
    finally:
        os.close(fd)
