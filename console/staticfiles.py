"""Static files with their content's hash in their names, so that browsers keep them a year.

After ``collectstatic`` (``scripts/up``), WhiteNoise serves the collected, compressed copies and
Django's manifest names them (``console.css`` -> ``console.3f0a….css``).  Where nobody has run it
(the test stack, a fresh checkout), the same names are made from the sources as they are found,
and the middleware serves each source under its hashed name too: the pages link the same kind of
URL either way, and a hashed URL is answered ``Cache-Control: max-age=31536000, public,
immutable`` (plotly alone is 4.8 MB).  A changed file gets a new name, so nothing goes stale.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache

from django.contrib.staticfiles import finders
from whitenoise.middleware import WhiteNoiseMiddleware
from whitenoise.storage import CompressedManifestStaticFilesStorage

YEAR_S = 365 * 24 * 3600


@lru_cache(maxsize=4096)
def _source_hash(path: str, mtime_ns: int, size: int) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as source:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def _with_hash(name: str, path: str) -> str:
    found = os.stat(path)
    stem, extension = os.path.splitext(name)
    return f"{stem}.{_source_hash(path, found.st_mtime_ns, found.st_size)}{extension}"


def hashed_name(name: str) -> str | None:
    """``name`` with its source's hash (Django's manifest naming), found through the finders; None if there is none.
    (A source edited while the server runs gets its new name: the hash is kept per size and modification time.)"""
    found = finders.find(name)
    if not found or isinstance(found, list):
        return None
    return _with_hash(name, found)


class FingerprintedStorage(CompressedManifestStaticFilesStorage):  # type: ignore[misc]  # whitenoise ships no types
    """The manifest's names once collected; names hashed from the sources until then."""

    manifest_strict = False

    def stored_name(self, name: str) -> str:
        if self.hashed_files:  # a manifest was read: collectstatic has run
            return str(super().stored_name(name))
        return hashed_name(name.split("?", 1)[0].split("#", 1)[0]) or name


class Fingerprinted(WhiteNoiseMiddleware):  # type: ignore[misc]  # whitenoise ships no types
    """WhiteNoise, keeping hashed files a year, and serving sources under their hashed names too."""

    FOREVER = YEAR_S

    def add_files_from_finders(self) -> None:
        """Each source under its name and under its hashed name (WhiteNoise's own walk of the finders, once)."""
        files: dict[str, str] = {}
        for finder in finders.get_finders():
            for path, storage in finder.list(None):
                prefix = (getattr(storage, "prefix", None) or "").strip("/")
                name = f"{prefix}/{path}" if prefix else path
                files.setdefault(name.replace("\\", "/"), storage.path(path))  # the first match wins, as Django's
        stat_cache = {path: os.stat(path) for path in files.values()}
        for name, path in files.items():
            self.add_file_to_dictionary(self.static_prefix + name, path, stat_cache=stat_cache)
            self.add_file_to_dictionary(self.static_prefix + _with_hash(name, path), path, stat_cache=stat_cache)
