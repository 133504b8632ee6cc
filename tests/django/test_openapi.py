"""The committed OpenAPI document is the one the server publishes."""

from console.management.commands.forkyard_openapi import DOCUMENT, current_document


def test_committed_document_is_current():
    assert DOCUMENT.read_text() == current_document(), "run: manage.py forkyard_openapi"


def test_every_operation_lists_its_error_responses():
    import json

    document = json.loads(current_document())
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert "401" in codes, f"{method.upper()} {path} does not document 401"
            assert "429" in codes and "503" in codes, f"{method.upper()} {path} does not document 429/503"
