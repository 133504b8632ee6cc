"""Structured outputs: a JSON schema checked when asked for, and every answer checked against it.

A response whose content does not validate is never returned as a success:
the gateway asks again (``RETRIES``) and then answers ``502
invalid_structured_output``. Validation is the ``jsonschema`` library's
(Draft 2020-12 unless the schema names another), each schema's validator
built once and kept (``validator_for``); a schema that is not one is ``400
invalid_schema`` before anything is sent upstream.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from console.errors import InvalidRequest

RETRIES = 2  # more tries after an answer that did not validate
_CACHE_SIZE = 512
_validators: OrderedDict[str, Any] = OrderedDict()


def validator_for(schema: dict[str, Any], field: str) -> Any:
    """A validator of ``schema`` (kept: a trainer sends the same schema thousands of times); ``invalid_schema``
    naming ``field`` if it is not a JSON schema."""
    key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    found = _validators.get(key)
    if found is not None:
        _validators.move_to_end(key)
        return found
    kind = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        kind.check_schema(schema)
    except jsonschema.exceptions.SchemaError as error:
        raise InvalidRequest("invalid_schema", f"{field} is not a JSON schema: {error.message[:300]}", field=field) from None
    validator = kind(schema, format_checker=kind.FORMAT_CHECKER)
    _validators[key] = validator
    if len(_validators) > _CACHE_SIZE:
        _validators.popitem(last=False)
    return validator


def problem(validator: Any, text: str | None, must_be_object: bool = False) -> str | None:
    """Why ``text`` is not a JSON document valid under ``validator`` (None: it is)."""
    if text is None:
        return "the answer has no content"
    try:
        document = json.loads(text)
    except json.JSONDecodeError as decode_error:
        return f"the answer is not JSON ({decode_error.msg} at character {decode_error.pos})"
    if must_be_object and not isinstance(document, dict):
        return "the answer is not a JSON object"
    if validator is None:
        return None
    found = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if found is None:
        return None
    where = "/".join(str(part) for part in found.absolute_path) or "the answer"
    return f"{where}: {str(found.message)[:300]}"


def choice_problem(choice: dict[str, Any], schema_validator: Any, kind: str | None, tool_validators: dict[str, Any]) -> str | None:
    """Why a choice of a completion breaks its request's structure (None: it keeps it)."""
    message = choice.get("message") or {}
    if kind in ("json_schema", "json_object") and not message.get("tool_calls"):
        return problem(schema_validator, message.get("content"), must_be_object=kind == "json_object")
    for call in message.get("tool_calls") or []:
        function = (call or {}).get("function") or {}
        validator = tool_validators.get(function.get("name", ""))
        if validator is not None:
            found = problem(validator, function.get("arguments"))
            if found:
                return f"tool call {function.get('name')!r}: {found}"
    return None
