"""The API's contract enforced from its own OpenAPI document: a query parameter it does not name is refused.

A misspelt option (``?lable=``, ``?timeout=``) used to be ignored, and the
caller got an answer to a question it did not ask.  The published document
already says which parameters each operation takes, so the API's handler
checks every request's query against it before anything runs: an unknown
one is ``400 unknown_parameter``, naming it.  (Unknown fields of a JSON body
are refused by the request schemas themselves, ``extra="forbid"``.)
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from django.conf import settings

from sandboxes.engine import data_path

from .errors import InvalidRequest
from .urls import api  # the API once every router is mounted on it


def _document() -> dict[str, Any]:
    """The published document: the committed copy (``docs/openapi.json``, which the suite checks is what the
    API generates), read in a millisecond; generated only without it (django-ninja takes seconds to)."""
    published = Path(settings.BASE_DIR) / "docs" / "openapi.json"
    try:
        document: dict[str, Any] = json.loads(published.read_text())
        return document
    except (OSError, ValueError):
        return dict(api.get_openapi_schema(path_prefix="/api/v1"))


@functools.cache
def _operations() -> list[tuple[str, re.Pattern[str], frozenset[str]]]:
    """(method, path pattern, the query parameters it takes) for every operation of the document."""
    document = _document()
    operations = []
    for template, methods in document["paths"].items():
        pattern = re.compile("^" + re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(template)) + "/?$")
        for method, operation in methods.items():
            names = frozenset(p["name"] for p in operation.get("parameters", []) if p.get("in") == "query")
            operations.append((method.upper(), pattern, names))
    return operations


def unknown_parameter(scope: Mapping[str, Any]) -> InvalidRequest | None:
    """The refusal for a query parameter the operation does not take; None if every one is known (or no
    operation matches: the router answers that with its own 404 or 405)."""
    query = scope.get("query_string", b"")
    if not query:
        return None
    given = {name for name, _ in parse_qsl(bytes(query).decode("latin1"), keep_blank_values=True)}
    for method, pattern, names in _operations():
        if method == scope["method"] and pattern.match(scope["path"]):
            unknown = sorted(given - names)
            if not unknown:
                return None
            refusal = data_path.unknown_parameter(method, scope["path"], unknown, sorted(names))
            return InvalidRequest(refusal.code, refusal.message, field=refusal.field, details=refusal.details)
    return None
