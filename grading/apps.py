from django.apps import AppConfig


class GradingConfig(AppConfig):
    name = "grading"
    verbose_name = "Grading and inference"

    def ready(self) -> None:
        # Django's place for connecting signals and hooks: the models are loaded by now.
        from . import (
            agent,  # noqa: F401 - adds the dedicated endpoints' pass to each host agent
            signals,  # noqa: F401 - forgets remembered routes when what they name changes
        )
