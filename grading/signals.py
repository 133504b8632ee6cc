"""What the gateway remembers of a team (routes, settings, budgets) is forgotten when one of them changes."""

from __future__ import annotations

from django.db.models.signals import post_delete, post_save

from billing.models import Budget, Price
from console.models import Team

from .gateway import forget_configs
from .models import Endpoint, KeyInference, TeamInference, Upstream

for model in (Upstream, Endpoint, TeamInference, KeyInference, Team, Budget, Price):
    post_save.connect(forget_configs, sender=model, dispatch_uid=f"grading-forget-{model.__name__}")
    post_delete.connect(forget_configs, sender=model, dispatch_uid=f"grading-forget-deleted-{model.__name__}")
