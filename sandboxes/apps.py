from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "sandboxes"
    verbose_name = "Sandboxes"

    def ready(self) -> None:
        # Django's place for connecting signals: the models are loaded by now.
        from django.db.models.signals import post_delete

        from console.keys import key_revoked
        from console.models import ApiKey

        from . import agent  # noqa: F401 - connects the worker's host agent to Celery's signals
        from .gateway_access import key_revoked as refuse_its_tokens

        # A key revoked or deleted: its data tokens are refused by every host's gateway from then on.
        key_revoked.connect(refuse_its_tokens, dispatch_uid="forkyard-refuse-revoked-tokens")
        post_delete.connect(
            lambda sender, instance, **_: refuse_its_tokens(key=instance),
            sender=ApiKey,
            weak=False,
            dispatch_uid="forkyard-refuse-deleted-tokens",
        )
