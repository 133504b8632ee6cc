"""Write the public API's OpenAPI document to docs/openapi.json, or check it is current."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from console.urls import api

DOCUMENT = Path(settings.BASE_DIR) / "docs" / "openapi.json"


def current_document() -> str:
    return json.dumps(api.get_openapi_schema(path_prefix="/api/v1"), indent=4, sort_keys=True) + "\n"


class Command(BaseCommand):
    help = "Regenerate docs/openapi.json (--check: fail if it is out of date)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--check", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        generated = current_document()
        if options["check"]:
            if not DOCUMENT.exists() or DOCUMENT.read_text() != generated:
                raise CommandError("docs/openapi.json is out of date: run manage.py forkyard_openapi")
            self.stdout.write("docs/openapi.json is current")
            return
        DOCUMENT.write_text(generated)
        self.stdout.write(f"wrote {DOCUMENT}")
