"""A local copy of the part of Debian's archive the shipped environments install, for the tests that
build them from their specs (tests/environments).

Tests send traffic only to this machine, so the archive is fetched here, by ``scripts/bootstrap``, once
per machine: in a copy of the bootstrap's Debian root filesystem, apt itself resolves and downloads
the specs' ``apt`` packages (``--download-only``), and its lists become the archive's index. The index
is Debian's own, signed ``InRelease`` and all, so apt in a build sandbox checks it against Debian's
key exactly as it would the real archive; only the packages the specs need are in the pool.

Layout, as a mirror of ``http://deb.debian.org/debian`` has it under ``debian/``:
``dists/bookworm/InRelease``, each list at its path and under ``by-hash/SHA256/`` (apt asks by hash
first), and ``pool/...`` at each package's ``Filename``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

ARCHIVE = Path(os.environ.get("FORKYARD_DEBIAN_ARCHIVE", "/var/cache/forkyard/debian-archive"))
ENVIRONMENTS = Path(__file__).resolve().parents[2] / "sandboxes" / "environments"
LISTS = "var/lib/apt/lists"
PREFIX = "deb.debian.org_debian_"  # how apt names a list of http://deb.debian.org/debian


def spec_packages(names: Iterable[str]) -> list[str]:
    """The Debian packages the shipped specs ``names`` install, in order, each once."""
    packages: list[str] = []
    for name in names:
        spec = json.loads((ENVIRONMENTS / f"{name}.json").read_text())
        for step in spec["steps"]:
            packages += [package for package in step.get("apt", []) if package not in packages]
    return packages


def build(base: Path, target: Path, groups: list[list[str]]) -> None:
    """The archive at ``target`` (replaced), holding each group of packages and what it depends on beyond
    ``base``. Each group (a spec's packages) is resolved on its own, as its build will resolve it: together,
    one group's package can satisfy another's "a | b" dependency with the one that group would not pick."""
    with tempfile.TemporaryDirectory(prefix="fy-archive-", dir=target.parent) as work:
        root = Path(work) / "root"
        subprocess.run(["cp", "-a", str(base), str(root)], check=True)
        resolv = root / "etc" / "resolv.conf"
        resolv.unlink(missing_ok=True)
        shutil.copyfile("/etc/resolv.conf", resolv)
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        try:
            fetch = "apt-get install -y -q --download-only --no-install-recommends"
            script = " && ".join(["apt-get update -q", *(f"{fetch} {shlex.join(group)}" for group in groups)])
            command = ["chroot", str(root), "/usr/bin/env", "DEBIAN_FRONTEND=noninteractive", "sh", "-c", script]
            done = subprocess.run(command, capture_output=True, text=True)
        finally:
            subprocess.run(["umount", str(root / "proc")], check=False)
        if done.returncode != 0:
            raise SystemExit(f"apt-get --download-only failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        staged = Path(work) / "archive"
        _lay_out(root, staged / "debian")
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)


def _lay_out(root: Path, mirror: Path) -> None:
    lists = root / LISTS
    release = lists / f"{PREFIX}dists_bookworm_InRelease"
    dists = mirror / "dists" / "bookworm"
    dists.mkdir(parents=True)
    shutil.copyfile(release, dists / "InRelease")
    listed = _sha256_entries(release.read_text())
    packages_text = ""
    for path in sorted(lists.glob(f"{PREFIX}dists_bookworm_*")):
        relative = path.name.removeprefix(f"{PREFIX}dists_bookworm_").replace("_", "/")
        if relative == "InRelease":
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if listed.get(relative) != digest:
            raise SystemExit(f"{relative}: apt's list does not match InRelease's SHA256")
        placed = dists / relative
        placed.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, placed)
        by_hash = placed.parent / "by-hash" / "SHA256" / digest
        by_hash.parent.mkdir(parents=True, exist_ok=True)
        os.link(placed, by_hash)
        if relative.endswith("/Packages"):
            packages_text += path.read_text() + "\n"
    where = _pool_paths(packages_text)
    downloaded = root / "var" / "cache" / "apt" / "archives"
    for deb in sorted(downloaded.glob("*.deb")):
        pool = mirror / where[deb.name]
        pool.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(deb, pool)


def _sha256_entries(release: str) -> dict[str, str]:
    """InRelease's SHA256 section: path -> digest."""
    entries: dict[str, str] = {}
    inside = False
    for line in release.splitlines():
        if not line.startswith(" "):
            inside = line.startswith("SHA256:")
            continue
        if inside:
            digest, _size, path = line.split()
            entries[path] = digest
    return entries


def _pool_paths(packages: str) -> dict[str, str]:
    """The name apt gives a downloaded package (epoch's colon escaped) -> its Filename in the pool."""
    where: dict[str, str] = {}
    for stanza in packages.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if "Filename" in fields:
            version = fields["Version"].replace(":", "%3a")
            where[f"{fields['Package']}_{version}_{fields['Architecture']}.deb"] = fields["Filename"]
    return where


def main() -> None:
    """``python -m tests.support.debian_archive BASE [SPEC...]``: the archive of those specs' packages,
    made again only when the packages they name changed."""
    base, *names = sys.argv[1:]
    names = names or ["python", "node"]
    groups = [spec_packages([name]) for name in names]
    packages = [package for group in groups for package in group]
    wanted = "".join(f"{name}: {' '.join(group)}\n" for name, group in zip(names, groups, strict=True))
    listed = ARCHIVE / "packages"
    if listed.exists() and listed.read_text() == wanted:
        return  # made before, for the specs as they are
    ARCHIVE.parent.mkdir(parents=True, exist_ok=True)
    build(Path(base), ARCHIVE, groups)
    listed.write_text(wanted)
    count = sum(1 for _ in ARCHIVE.rglob("*.deb"))
    print(f"debian archive: {count} packages for {', '.join(dict.fromkeys(packages))} at {ARCHIVE}")


if __name__ == "__main__":
    main()
