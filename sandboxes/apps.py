from django.apps import AppConfig


class SandboxesConfig(AppConfig):
    name = "sandboxes"
    verbose_name = "Sandboxes"

    def ready(self) -> None:
        from . import signals  # noqa: F401 - registers the worker's host agent
