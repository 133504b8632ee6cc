"""Prepare a deployment: prices, and optionally a demo team with a user and an API key."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand

from billing.services import install_default_prices
from console.keys import api_key_create
from console.models import Membership, Team
from console.services import team_create


class Command(BaseCommand):
    help = "Install default prices; with --demo, create a demo team, user and API key (printed once)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--demo", action="store_true")
        parser.add_argument("--team", default="Demo")
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default=None)
        parser.add_argument("--key-file", default=None, help="also write the key (and URL) here, mode 0600")

    def handle(self, *args: Any, **options: Any) -> None:
        created = install_default_prices()
        self.stdout.write(f"prices: {created} added")
        if not options["demo"]:
            return
        user, made_user = User.objects.get_or_create(
            username=options["username"], defaults={"email": f"{options['username']}@example.com"}
        )
        password = options["password"]
        if made_user or password:
            password = password or secrets.token_urlsafe(12)
            user.set_password(password)
            user.save()
        team = Team.objects.filter(memberships__user=user, name=options["team"]).first()
        if team is None:
            team = team_create(name=options["team"], owner=user)
        elif not Membership.objects.filter(team=team, user=user).exists():
            Membership.objects.create(team=team, user=user, role="owner")
        new = api_key_create(team=team, name="demo", created_by=user)
        self.stdout.write(f"team: {team.name} ({team.id})")
        if password:
            self.stdout.write(f"console login: {user.username} / {password}")
        self.stdout.write(f"API key (shown once): {new.secret}")
        if options["key_file"]:
            path = Path(options["key_file"])
            path.write_text(json.dumps({"api_key": new.secret, "team": team.id, "username": user.username, "password": password}))
            path.chmod(0o600)
