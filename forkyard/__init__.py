"""forkyard's Python SDK: sandboxes for reinforcement-learning rollouts, over the public API.

```python
from forkyard import Client

fy = Client()                          # FORKYARD_URL, FORKYARD_API_KEY
sb = fy.sandboxes.create(template="base", size="tiny", ttl_s=600)
r = sb.exec("python -V"); r.exit_code, r.stdout
sb.files.write("/data/a.py", b"print(1)")
snap = sb.snapshot(name="deps-installed")          # waits until it is ready
launch = fy.launches.create(snapshot=snap.id, count=1000)
for child in launch.wait(): ...
sb.kill()
```

``AsyncClient`` has the same surface with ``async`` methods.  Errors are
``ForkyardError`` subclasses (``NotFound``, ``RateLimited``, ``NoCapacity``...).
Needs only httpx: no Django.
"""

from ._http import RateLimit, RetryPolicy
from ._pages import Page
from ._version import __version__
from .aio import AsyncClient, AsyncExecStream, AsyncLaunch, AsyncSandbox, AsyncSnapshot
from .client import Client, ExecStream, Launch, Sandbox, Snapshot
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
    Unauthorized,
    Unavailable,
    WaitTimeout,
)
from .models import (
    ApiKey,
    CreatedKey,
    EgressRule,
    ExecChunk,
    ExecResult,
    FileEntry,
    FileListing,
    LaunchProgress,
    NetworkPolicy,
    Service,
    Template,
    Usage,
    WhoAmI,
)

__all__ = [
    "ApiKey", "AsyncClient", "AsyncExecStream", "AsyncLaunch", "AsyncSandbox", "AsyncSnapshot", "Client", "ConfigurationError", "Conflict",
    "CreatedKey", "EgressRule", "ExecChunk", "ExecResult", "ExecStream", "FileEntry", "FileListing", "Forbidden", "ForkyardError",
    "InvalidRequest", "Launch", "LaunchProgress", "NetworkPolicy", "NoCapacity", "NotFound", "NotImplementedByServer", "Page",
    "RateLimit", "RateLimited", "RetryPolicy", "Sandbox", "ServerError", "Service", "Snapshot", "SnapshotFailed", "Template", "Unauthorized", "Unavailable",
    "Usage", "WaitTimeout", "WhoAmI", "__version__",
]
