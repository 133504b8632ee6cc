"""Grading's records: upstreams and dedicated endpoints (where inference goes), and what was asked of them.

What is kept by default is metadata only: who called, which model, how many
tokens, how long, with what outcome (``InferenceCall``, ``Grade``).  Prompts
and outputs are kept only for a team that turned retention on, sealed, and
for at most its days (``RetainedContent``; purged by a periodic task).
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from console.models import ApiKey, Team, public_id
from console.sealing import SealedJSONField
from sandboxes.models import Host


def upstream_id() -> str:
    return public_id("up")


def endpoint_id() -> str:
    return public_id("ep")


def call_id() -> str:
    return public_id("ic")


def grade_id() -> str:
    return public_id("gr")


class Upstream(models.Model):
    """An OpenAI-compatible provider an operator configured (Django admin); never shown to teams.

    ``serves`` are the model names teams ask for; ``model_names`` may map one of them
    to the provider's own name.  ``keeps_prompts`` says whether the provider
    keeps what it is sent (abuse logs, training): a team or key that requires
    zero retention is routed only to upstreams that keep nothing, and refused
    otherwise.  Unknown is "keeps": it fails closed.
    """

    id = models.CharField(primary_key=True, max_length=32, default=upstream_id, editable=False)
    name = models.CharField(max_length=100, unique=True)
    base_url = models.URLField(max_length=500, help_text="the API's base, e.g. https://api.example.com/v1")
    secret = SealedJSONField(default="", blank=True, help_text="its API key; stored sealed, never shown again")
    serves = models.JSONField(default=list, help_text='the model names it serves, as teams ask for them: ["gpt-x", ...]')
    model_names = models.JSONField(default=dict, blank=True, help_text='{"name teams use": "the provider\'s own name"}')
    keeps_prompts = models.BooleanField(default=True, help_text="the provider keeps prompts or outputs (logs, training)")
    enabled = models.BooleanField(default=True)
    timeout_s = models.PositiveIntegerField(default=120, help_text="longest wait for its answer (or its next chunk)")
    priority = models.PositiveSmallIntegerField(default=100, help_text="lower first, among upstreams serving a model")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class ServedModel(models.Model):
    """An open model an operator offers for dedicated endpoints: its weights on every host, and its server."""

    class Server(models.TextChoices):
        LLAMA_CPP = "llama_cpp", "llama.cpp (CPU hosts: GGUF weights, grammar-constrained JSON)"
        VLLM = "vllm", "vLLM (GPU hosts: Hugging Face weights, guided decoding)"

    name = models.CharField(primary_key=True, max_length=100, help_text="what a team names in POST /api/v1/endpoints")
    server = models.CharField(max_length=16, choices=Server.choices, default=Server.LLAMA_CPP)
    path = models.CharField(max_length=500, help_text="the weights on each host (a GGUF file; a model directory for vLLM)")
    context_length = models.PositiveIntegerField(default=2048)
    threads = models.PositiveSmallIntegerField(default=0, help_text="CPU threads for its server (0: the server's choice)")
    description = models.CharField(max_length=255, blank=True)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class Endpoint(models.Model):
    """A team's dedicated endpoint: a model server process on one host, supervised by its engine."""

    class State(models.TextChoices):
        QUEUED = "queued"  # recorded, its command not yet run on its host
        STARTING = "starting"  # the engine runs its server; not answering yet
        READY = "ready"  # answering: its model is in the team's /models
        FAILED = "failed"  # it could not be started
        STOPPING = "stopping"  # deleted; its server not yet gone
        DELETED = "deleted"

    LIVE = (State.QUEUED, State.STARTING, State.READY, State.STOPPING)
    HOLDING = (State.STARTING, State.READY)  # its server holds its host: billed

    id = models.CharField(primary_key=True, max_length=32, default=endpoint_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="endpoints")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    model = models.ForeignKey(ServedModel, on_delete=models.PROTECT, related_name="endpoints")
    name = models.CharField(max_length=100, help_text="the model id the team's calls name")
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.PROTECT, related_name="endpoints")
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    address = models.CharField(max_length=255, blank=True)  # http://host:port of its server, once started
    token = SealedJSONField(default="", blank=True)  # what its server asks of the gateway: sealed
    restarts = models.PositiveIntegerField(default=0)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "name"],
                condition=models.Q(state__in=["queued", "starting", "ready", "stopping"]),
                name="one_live_endpoint_per_team_and_name",
            )
        ]
        indexes = [models.Index(fields=["team", "created_at"]), models.Index(fields=["host", "state"])]

    def __str__(self) -> str:
        return f"{self.id} ({self.name})"


class TeamInference(models.Model):
    """A team's inference settings: its limits (an operator's), and whether it requires zero retention."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, primary_key=True, related_name="inference")
    zero_retention = models.BooleanField(
        default=False, help_text="route only to upstreams that keep nothing; refuse a model that only a keeping one serves"
    )
    requests_per_minute = models.PositiveIntegerField(default=60_000)
    tokens_per_minute = models.PositiveBigIntegerField(default=50_000_000)

    class Meta:
        verbose_name_plural = "team inference settings"


class KeyInference(models.Model):
    """A key that requires zero retention, whatever its team's setting."""

    key = models.OneToOneField(ApiKey, on_delete=models.CASCADE, primary_key=True, related_name="inference")
    zero_retention = models.BooleanField(default=True)


class InferenceCall(models.Model):
    """One call through the gateway: metadata only (never a prompt or an output)."""

    id = models.CharField(primary_key=True, max_length=32, default=call_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="inference_calls")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    model = models.CharField(max_length=200)
    upstream = models.ForeignKey(Upstream, null=True, blank=True, on_delete=models.SET_NULL)
    endpoint = models.ForeignKey(Endpoint, null=True, blank=True, on_delete=models.SET_NULL)
    grade = models.ForeignKey("Grade", null=True, blank=True, on_delete=models.CASCADE, related_name="calls")
    stream = models.BooleanField(default=False)
    status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    latency_ms = models.FloatField(default=0)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["team", "created_at"])]


class Grade(models.Model):
    """One ``POST /api/v1/grades``: its items' outcome in numbers; their content only under retention."""

    id = models.CharField(primary_key=True, max_length=32, default=grade_id, editable=False)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="grades")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL)
    model = models.CharField(max_length=200)
    score_field = models.CharField(max_length=100)
    items = models.PositiveIntegerField()
    succeeded = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    mean_score = models.FloatField(null=True, blank=True)
    input_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    latency_ms = models.FloatField(default=0)
    retained = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [models.Index(fields=["team", "created_at"])]


class RetainedContent(models.Model):
    """Prompts and outputs of a team that asked for retention: sealed, and deleted at ``expires_at``."""

    class Kind(models.TextChoices):
        INFERENCE = "inference"
        GRADE = "grade"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="retained_content")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    call = models.OneToOneField(InferenceCall, null=True, blank=True, on_delete=models.CASCADE, related_name="content")
    grade = models.OneToOneField(Grade, null=True, blank=True, on_delete=models.CASCADE, related_name="content")
    content = SealedJSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        indexes = [models.Index(fields=["team", "created_at"])]
