"""Settings for forkyard's control plane: embedded defaults, overridden by the environment.

With no configuration at all, one machine runs everything on embedded parts:
SQLite, a filesystem broker for Celery and a database-backed channel layer,
all of which work across the web, worker and beat processes.  Production sets:

    DATABASE_URL=postgres://...          the database
    REDIS_URL=redis://host:6379/0         broker, channel layer, rate limits, notifications
    CELERY_BROKER_URL=amqp://...          (optional) RabbitMQ as the broker instead
    FORKYARD_SECRET_KEY=...               signs sessions, hashes API keys
    FORKYARD_REGION=eu-west-1             named in every API response
"""

from __future__ import annotations

import os
import secrets
from importlib.util import find_spec
from pathlib import Path

import django_stubs_ext
import environ

# Lets the classes that django-stubs makes generic (ModelAdmin[Team], StackedInline[TeamLimits, Team]) be subscripted at run time.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()
# What the control plane keeps (its database, the broker's messages, the secret key) is its own:
# the data directory is 0700, and the database's files 0600 (console.apps).
DATA_DIR = Path(env.str("FORKYARD_DATA_DIR", default=str(BASE_DIR / "var")))
DATA_DIR.mkdir(parents=True, exist_ok=True)
DATA_DIR.chmod(0o700)


def _secret_key() -> str:
    """From the environment, or generated once and kept beside the data."""
    if "FORKYARD_SECRET_KEY" in os.environ:
        return os.environ["FORKYARD_SECRET_KEY"]
    path = DATA_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(48))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env.bool("FORKYARD_DEBUG", default=False)
# Served over TLS (directly, or behind a proxy that says so in X-Forwarded-Proto): cookies only
# over TLS, and browsers told to keep to it (HSTS, a year).
FORKYARD_TLS = env.bool("FORKYARD_TLS", default=False)
if FORKYARD_TLS:
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = 365 * 24 * 3600
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env.bool("FORKYARD_TLS_REDIRECT", default=True)
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
ALLOWED_HOSTS = env.list("FORKYARD_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env.list("FORKYARD_CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "channels",
    "console",
    "sandboxes",
    "billing",
    "grading",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "console.staticfiles.Fingerprinted",  # WhiteNoise: hashed names, kept a year
    "console.middleware.DependencyErrorsMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "console.middleware.ContentSecurityPolicyMiddleware",
]

# Bodies are bounded per endpoint before Django sees them (console/bodies.py); Django's own
# 2.5 MB check would turn an API exec with a large stdin into a 500.
DATA_UPLOAD_MAX_MEMORY_SIZE = None
# The API's own stack (console/asgi.py): async middleware only, no sessions or CSRF (it authenticates by key).
API_PREFIX = "/api/"
API_MIDDLEWARE = ["console.middleware.DependencyErrorsMiddleware"]

ROOT_URLCONF = "console.urls"
ASGI_APPLICATION = "console.asgi.application"
WSGI_APPLICATION = "console.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.context.console",
            ],
        },
    },
]

# --- database -------------------------------------------------------------------------

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{DATA_DIR / 'forkyard.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL: readers never wait for the writer, across processes.  The
    # immediate transaction mode takes the write lock at BEGIN, so two
    # processes never deadlock upgrading a read lock.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        # secure_delete: freed pages are zeroed, not left holding what was deleted;
        # journal_size_limit: the write-ahead log is cut back to nothing once
        # checkpointed, not left holding old pages (the host agent checkpoints it).
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA secure_delete=ON; PRAGMA journal_size_limit=0;",
    }
    # Tests on a file too, as in production: Django's default in-memory test
    # database shares one cache between connections, where a reader in another
    # thread (the board's ticker) makes a writer fail at once with "table is
    # locked" instead of waiting its turn.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test-forkyard.sqlite3")}
# Keep connections between requests: opening one per request costs more than
# the request itself (and under Daphne every request would).
DATABASES["default"].setdefault("CONN_MAX_AGE", 600)
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)
if "FORKYARD_TEST_DB_NAME" in os.environ:
    # Test sessions sharing one database server each get their own test database.
    DATABASES["default"]["TEST"] = {"NAME": os.environ["FORKYARD_TEST_DB_NAME"]}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- broker, channel layer, cache ----------------------------------------------------------

REDIS_URL = env.str("REDIS_URL", default="")
BROKER_DIR = DATA_DIR / "broker"
# Several deployments (or test sessions) may share one Redis: prefix what we put there.
REDIS_PREFIX = env.str("FORKYARD_REDIS_PREFIX", default="fy")
if REDIS_URL:
    CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL], "prefix": f"{REDIS_PREFIX}:asgi"},
        }
    }
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL, "KEY_PREFIX": REDIS_PREFIX}
    }
else:
    # Embedded: a directory is the broker (kombu's filesystem transport), the
    # database is the channel layer.  Both work across processes on one host.
    CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="filesystem://")
    CHANNEL_LAYERS = {"default": {"BACKEND": "console.channel_layer.DatabaseChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
if CELERY_BROKER_URL.startswith("filesystem"):
    CELERY_BROKER_URL = "fyfs://"  # console.broker: the filesystem transport, written atomically
    for folder in ("queue", "processed", "control"):
        (BROKER_DIR / folder).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "control_folder": str(BROKER_DIR / "control"),
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "store_processed": False,
        "polling_interval": env.float("FORKYARD_BROKER_POLL_S", default=0.01),
    }
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}

CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = env.str("FORKYARD_CONTROL_QUEUE", default="control")
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# --- the product ---------------------------------------------------------------------------

FORKYARD_REGION = env.str("FORKYARD_REGION", default="local")
FORKYARD_HOST_NAME = env.str("FORKYARD_HOST_NAME", default=os.uname().nodename)
FORKYARD_ENGINE_SOCKET = env.str("FORKYARD_ENGINE_SOCKET", default="/run/forkyard/engine.sock")
# How the web servers and other hosts' workers reach this host's engine: its
# socket when everything runs on one machine; tcp://<private address>:<port>
# when hosts join (the engine listens there with FORKYARD_ENGINE_LISTEN), with
# the token every engine of the deployment shares.
FORKYARD_ENGINE_ADDRESS = env.str("FORKYARD_ENGINE_ADDRESS", default=FORKYARD_ENGINE_SOCKET)
FORKYARD_ENGINE_TOKEN = env.str("FORKYARD_ENGINE_TOKEN", default="")
FORKYARD_HOST_STALE_S = env.int("FORKYARD_HOST_STALE_S", default=30)
# A host whose heartbeat is this old has lost its sandboxes: the started ones end (host_lost), billed up to it.
FORKYARD_HOST_LOST_S = env.int("FORKYARD_HOST_LOST_S", default=300)
# Admission and placement (sandboxes/placement.py): what a sandbox costs a host is the kernel's memory per
# sandbox (its engine's measure; this until it reports one) plus its memory limit over this ratio (limits are
# ceilings: only idle memory lets many small sandboxes share a host), out of the host's memory less a reserve.
FORKYARD_MEMORY_OVERCOMMIT = env.float("FORKYARD_MEMORY_OVERCOMMIT", default=8.0)
FORKYARD_SANDBOX_OVERHEAD_KIB = env.int("FORKYARD_SANDBOX_OVERHEAD_KIB", default=600)
FORKYARD_HOST_MEMORY_RESERVE_MIB = env.int("FORKYARD_HOST_MEMORY_RESERVE_MIB", default=1024)
FORKYARD_CREATE_WAIT_S = env.float("FORKYARD_CREATE_WAIT_S", default=30.0)
# The largest file or tar the API takes in one upload (streamed to the engine, never held whole).
FORKYARD_MAX_UPLOAD_BYTES = env.int("FORKYARD_MAX_UPLOAD_BYTES", default=1024 * 1024 * 1024)
# The largest image archive POST /snapshots/import takes (streamed to a host, whose engine has its own
# limit too: FORKYARD_ENGINE_MAX_IMAGE_MIB).
FORKYARD_MAX_IMAGE_BYTES = env.int("FORKYARD_MAX_IMAGE_BYTES", default=16 * 1024 * 1024 * 1024)
# A well-formed command or small file is answered without Django's request machinery
# (sandboxes/api/hot_path.py); off, every request goes through its view.
FORKYARD_HOT_PATH = env.bool("FORKYARD_HOT_PATH", default=True)
# Where the board's page opens its websocket (Daphne): this URL, or the page's own host on this port.
FORKYARD_WEBSOCKET_URL = env.str("FORKYARD_WEBSOCKET_URL", default="")
FORKYARD_WEBSOCKET_PORT = env.int("FORKYARD_WEBSOCKET_PORT", default=8001)
# Preview URLs of sandboxes' exposed ports (console/preview.py): http://{port}-{sandbox}.{domain}[:{port}].
# The default works on one machine (Chromium and curl resolve *.localhost to loopback) on the port the
# API was reached on; a deployment names a wildcard domain served by its web servers.
FORKYARD_PREVIEW_DOMAIN = env.str("FORKYARD_PREVIEW_DOMAIN", default="localhost").lower().strip(".")
FORKYARD_PREVIEW_SCHEME = env.str("FORKYARD_PREVIEW_SCHEME", default="http")
FORKYARD_PREVIEW_PORT = env.int("FORKYARD_PREVIEW_PORT", default=0)  # 0: the port the API was reached on
FORKYARD_LAUNCH_CHUNK = env.int("FORKYARD_LAUNCH_CHUNK", default=250)
FORKYARD_RECONCILE_S = env.float("FORKYARD_RECONCILE_S", default=5.0)
# A command lost with a worker (or the embedded broker) is queued again after this.
FORKYARD_STUCK_AFTER_S = env.float("FORKYARD_STUCK_AFTER_S", default=60.0)
FORKYARD_CONTENT_RETENTION_DAYS = 30
# Mail (budget alerts, invitations): FORKYARD_EMAIL_URL, e.g. smtp+tls://user:password@mail.example.org:587;
# by default a message is written to the sending process's log instead (nothing is configured to send it).
vars().update(env.email_url("FORKYARD_EMAIL_URL", default="consolemail://"))
DEFAULT_FROM_EMAIL = env.str("FORKYARD_EMAIL_FROM", default="forkyard <forkyard@localhost>")

# --- the rest of Django ----------------------------------------------------------------------

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "/static/"
STATIC_ROOT = DATA_DIR / "static"
# Plotly's JavaScript comes with the Python package: served from there, never from a CDN
# (found without importing plotly, which every process would otherwise pay for).
PLOTLY_PACKAGE_DATA = Path(find_spec("plotly").origin or "").resolve().parent / "package_data"  # type: ignore[union-attr]
# django-ninja's Swagger UI, for the API's docs page (/api/v1/docs): served from here, never a CDN.
NINJA_STATIC = Path(find_spec("ninja").origin or "").resolve().parent / "static" / "ninja"  # type: ignore[union-attr]
STATICFILES_DIRS = [BASE_DIR / "static", ("vendor/plotly", PLOTLY_PACKAGE_DATA), ("vendor/ninja", NINJA_STATIC)]
# Production runs collectstatic (scripts/up does): WhiteNoise then serves the collected,
# compressed files.  Where nobody has (a fresh checkout, the test stack), it serves the
# sources through the finders instead; doing both would let the sources shadow the
# compressed copies.
WHITENOISE_USE_FINDERS = env.bool("FORKYARD_STATIC_FROM_SOURCE", default=not (STATIC_ROOT / "console.css").exists())
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "console.staticfiles.FingerprintedStorage"},
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(name)s %(levelname)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("FORKYARD_LOG_LEVEL", default="INFO")},
    # httpx logs each request at INFO (the gateway's calls upstream): a line per call, and its time on the call's path.
    "loggers": {"django.channels.server": {"level": "WARNING"}, "daphne": {"level": "WARNING"}, "httpx": {"level": "WARNING"}},
}
