"""Whom a command runs as: a user named by the sandbox's own ``/etc/passwd``.

An exec's ``user`` (a name, or a uid as a number or a string of digits) is
looked up in the sandbox's files, never the host's: ``/etc/passwd`` and
``/etc/group`` are read through the sandbox's tree (``trees.Tree``: resolved
in its root, no magic links, no other mounts, regular files only, bounded),
so a sandbox that makes them symlinks to ``/proc/...`` or FIFOs gets an
error, not the host's users or a stuck engine.  The ids are the sandbox's own
(its user namespace maps them onto its uid range); init switches to them in
the command's child (native/init.c).

* a name must be in ``/etc/passwd`` (else ``user_not_found``);
* a uid in ``/etc/passwd`` takes that entry's gid, groups and home; a uid
  that is not (a image without an entry for it) runs with gid = uid, no
  supplementary groups and ``HOME=/``;
* supplementary groups are the groups of ``/etc/group`` that list the name,
  as ``initgroups`` makes them;
* the command's environment gets ``HOME``, ``USER`` and ``LOGNAME`` of the
  user, unless the exec's own ``env`` names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import EngineError, FileNotFound, InvalidRequest, UserNotFound
from .execution import Identity
from .trees import Tree

MAX_ID = 65535  # a sandbox's user namespace maps 65,536 ids
MAX_DATABASE_BYTES = 1 << 20  # /etc/passwd and /etc/group, each
MAX_GROUPS = 256  # native/init.c
NAME = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,31}\$?$")


@dataclass(frozen=True)
class User:
    identity: Identity
    name: str
    home: str

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def validate(user: object) -> str | None:
    """An exec's ``user`` as given: None, a name, or digits (a uid)."""
    if user is None:
        return None
    if isinstance(user, int) and not isinstance(user, bool):
        if not 0 <= user <= MAX_ID:
            raise InvalidRequest(f"user {user} is outside the sandbox's ids (0..{MAX_ID})", field="user")
        return str(user)
    if not isinstance(user, str) or not (user.isdigit() and user.isascii() or NAME.match(user)):
        raise InvalidRequest("user must be a user name or a uid", field="user")
    if user.isdigit() and int(user) > MAX_ID:
        raise InvalidRequest(f"user {user} is outside the sandbox's ids (0..{MAX_ID})", field="user")
    return user


def _database(tree: Tree, path: str) -> list[list[str]]:
    """The entries of a colon-separated database; none if the file is absent."""
    try:
        data = tree.read_bytes(path, MAX_DATABASE_BYTES)
    except FileNotFound:
        return []
    except EngineError as error:  # a FIFO, a link out of the sandbox, a huge file: no users from it
        raise UserNotFound(f"the sandbox's {path} cannot be read: {error.message}", field="user", path=path) from None
    rows = []
    for line in data.decode("utf-8", "replace").splitlines():
        if line and not line.startswith(("#", "+", "-")):
            rows.append(line.split(":"))
    return rows


def _number(text: str) -> int | None:
    return int(text) if text.isdigit() and text.isascii() and int(text) <= MAX_ID else None


def resolve(tree: Tree, user: str) -> User:
    """The ids ``user`` (from :func:`validate`) stands for in this sandbox."""
    by_uid = user.isdigit()
    entry: list[str] | None = None
    for row in _database(tree, "/etc/passwd"):
        if len(row) < 7:
            continue
        if (by_uid and _number(row[2]) == int(user)) or (not by_uid and row[0] == user):
            entry = row
            break
    if entry is None:
        if not by_uid:
            raise UserNotFound(f"no user {user!r} in the sandbox's /etc/passwd", field="user", user=user)
        return User(Identity(int(user), int(user), ()), user, "/")
    found_uid, gid = _number(entry[2]), _number(entry[3])
    if found_uid is None or gid is None:
        raise UserNotFound(f"user {user!r} has ids outside the sandbox's range in /etc/passwd", field="user", user=user)
    name = entry[0]
    groups = [gid]
    for row in _database(tree, "/etc/group"):
        if len(row) >= 4 and name in row[3].split(","):
            number = _number(row[2])
            if number is not None and number not in groups:
                groups.append(number)
    return User(Identity(found_uid, gid, tuple(groups[:MAX_GROUPS])), name, entry[5] or "/")
