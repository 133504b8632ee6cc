"""forkyard's Python SDK: sandboxes for reinforcement-learning rollouts, over the public API.

```python
from forkyard import Client

fy = Client()                          # FORKYARD_URL, FORKYARD_API_KEY
sb = fy.sandboxes.create(template="base", size="tiny", ttl_s=600)
r = sb.exec("python -V"); r.exit_code, r.stdout
sb.files.write("/data/a.py", b"print(1)")
snap = sb.snapshot(name="deps-installed")          # waits until it is ready
launch = fy.launches.create(snapshot=snap.id, count=1000)
for child in launch.wait(): ...                  # each as it becomes ready
fy.exec_many("pytest -q", launch=launch.id)      # one command in each, results as they finish
fy.sandboxes.kill_all(label="run:7"); sb.kill()
```

``Client(lease=True)`` ties the sandboxes a client makes to its life (a
heartbeaten lease); ``kill_on_exit=True`` also kills them on SIGTERM and at exit.

Grading: ``fy.inference`` is the official OpenAI client pointed at forkyard (``forkyard[openai]``),
``fy.grades.create(...)`` grades rollouts with a judge model, ``sb.grade(cmd)`` is a test-based reward,
and ``fy.endpoints`` deploys dedicated open-model endpoints.

``AsyncClient`` has the same surface with ``async`` methods.  Errors are
``ForkyardError`` subclasses (``NotFound``, ``RateLimited``, ``NoCapacity``...).
Needs only httpx: no Django.
"""

from ._grading import DedicatedEndpoint, Grade, GradedItem, Reward
from ._http import RateLimit, RetryPolicy
from ._lifetime import LeaseOptions
from ._pages import Page
from ._templates import TemplateSpec
from ._version import __version__
from .aio import (
    AsyncClient,
    AsyncExecBatch,
    AsyncExecStream,
    AsyncLaunch,
    AsyncProcess,
    AsyncSandbox,
    AsyncSnapshot,
    AsyncWatchStream,
)
from .client import Client, ExecBatch, ExecStream, Launch, Process, Sandbox, Snapshot, WatchStream
from .errors import (
    ConfigurationError,
    Conflict,
    Forbidden,
    ForkyardError,
    InvalidRequest,
    NoCapacity,
    NotFound,
    NotImplementedByServer,
    RateLimited,
    ServerError,
    SnapshotFailed,
    TemplateBuildFailed,
    Unauthorized,
    Unavailable,
    UnknownOption,
    UnsafeArchive,
    WaitTimeout,
)
from .models import (
    ApiKey,
    BatchResult,
    BatchSummary,
    BuildStep,
    CreatedKey,
    DeniedAttempt,
    DesktopState,
    EgressRule,
    ExecChunk,
    ExecResult,
    ExposedPort,
    FileEntry,
    FileListing,
    Killed,
    LaunchProgress,
    Lease,
    LiveView,
    Metrics,
    NetworkMetrics,
    NetworkPolicy,
    ProcessOutput,
    ProcessStream,
    Screenshot,
    Service,
    Template,
    TemplateBuild,
    Usage,
    WatchEvent,
    WhoAmI,
)

__all__ = [
    "ApiKey",
    "AsyncClient",
    "AsyncExecBatch",
    "AsyncExecStream",
    "AsyncLaunch",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSnapshot",
    "AsyncWatchStream",
    "BatchResult",
    "BatchSummary",
    "Client",
    "ConfigurationError",
    "Conflict",
    "CreatedKey",
    "DedicatedEndpoint",
    "Grade",
    "GradedItem",
    "Reward",
    "EgressRule",
    "ExecBatch",
    "ExecChunk",
    "ExecResult",
    "ExposedPort",
    "ExecStream",
    "FileEntry",
    "FileListing",
    "Forbidden",
    "ForkyardError",
    "InvalidRequest",
    "Killed",
    "Launch",
    "LaunchProgress",
    "Lease",
    "LeaseOptions",
    "DeniedAttempt",
    "DesktopState",
    "LiveView",
    "Screenshot",
    "Metrics",
    "NetworkMetrics",
    "NetworkPolicy",
    "NoCapacity",
    "NotFound",
    "NotImplementedByServer",
    "Page",
    "Process",
    "ProcessOutput",
    "ProcessStream",
    "RateLimit",
    "RateLimited",
    "RetryPolicy",
    "Sandbox",
    "ServerError",
    "Service",
    "Snapshot",
    "SnapshotFailed",
    "Template",
    "TemplateBuild",
    "TemplateBuildFailed",
    "TemplateSpec",
    "BuildStep",
    "Unauthorized",
    "Unavailable",
    "UnknownOption",
    "UnsafeArchive",
    "Usage",
    "WaitTimeout",
    "WatchEvent",
    "WatchStream",
    "WhoAmI",
    "__version__",
]
