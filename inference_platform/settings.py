"""One settings module for every environment, driven by environment variables.

DEBUG is off unless asked for. With DEBUG off, SECRET_KEY and API_KEY_PEPPER must be given and the
HTTPS hardening below is on, so production settings pass `manage.py check --deploy`.
"""

from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from .env import env_bool, env_int, env_list, env_secret, local_secret

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = Path(env_secret("PLATFORM_STATE_DIR") or BASE_DIR / ".local")

DEBUG = env_bool("DEBUG", False)


def _secret(name: str) -> str:
    value = env_secret(name)
    if value:
        return value
    if DEBUG:
        return local_secret(STATE_DIR / name.lower())
    raise ImproperlyConfigured(
        f"Set {name} (or {name}_FILE) in the environment; it is required when DEBUG is off."
    )


SECRET_KEY = _secret("SECRET_KEY")
# The server-side pepper for API key HMACs. Changing it invalidates every issued key.
API_KEY_PEPPER = _secret("API_KEY_PEPPER")
API_KEY_PREFIX = "ipk"

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "axes",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "tenants",
    "serving",
    "routing",
    "portal",
    "sso",
    "alerts",
    "planner",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # Single sign-on sessions are checked with the provider again every OIDC_SESSION_REFRESH_S.
    "sso.refresh.SessionRefresh",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last: turns a sign-in refused for too many failures into its 429 page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "inference_platform.urls"
WSGI_APPLICATION = "inference_platform.wsgi.application"
# The web side (admin, portal and its WebSocket, REST API); the router is inference_platform/asgi.py.
ASGI_APPLICATION = "inference_platform.web_asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database_url() -> str:
    url = env_secret("DATABASE_URL")
    if not url:
        raise ImproperlyConfigured(
            "DATABASE_URL is not set. Start through `make run` / `make test` (they bring up an embedded "
            "PostgreSQL and Redis), or set DATABASE_URL and REDIS_URL to your own servers."
        )
    return url


DATABASES = {"default": dj_database_url.parse(_database_url(), conn_max_age=env_int("DB_CONN_MAX_AGE", 60))}
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"]["TEST"] = {"NAME": env_secret("TEST_DATABASE_NAME") or None}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL (postgres:// or postgresql://).")

REDIS_URL = env_secret("REDIS_URL")
if not REDIS_URL:
    raise ImproperlyConfigured(
        "REDIS_URL is not set. Start through `make run` / `make test`, or set it to your own Redis."
    )

CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
CHANNEL_LAYERS = {
    "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
}

CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# No remote control (celery inspect/control; nothing here uses it): its broadcast mailbox is a Redis pub/sub
# subscription, and when Redis goes away with tasks in flight, kombu's reconnect of that subscription raised
# AttributeError and the worker exited ("Unrecoverable error"), leaving usage uningested until restarted.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
# Work that waits on what a tenant controls runs on queues of its own, each served by workers of its own
# (devstack.py, deploy/base/), so it can never take the threads that reconcile, autoscaling, usage ingestion and
# quota restore need (they stay on the default queue, "celery"): alert deliveries wait on tenants' webhooks,
# what-if runs replay a whole trace.
CELERY_TASK_ROUTES = {
    "alerts.tasks.deliver": {"queue": "alerts"},
    "alerts.tasks.deliver_due": {"queue": "alerts"},
    "planner.run_what_if": {"queue": "whatif"},
}
# Every deployment is reconciled this often, whatever changed; a change also enqueues its own reconcile.
RECONCILE_INTERVAL_S = env_int("RECONCILE_INTERVAL_S", 5)
# The autoscaler (serving/autoscaling.py): how often it decides, over how long a window it reads TTFT and ITL,
# and the start-up time it assumes for a pool none of whose engines has started yet.
AUTOSCALER_INTERVAL_S = float(env_secret("AUTOSCALER_INTERVAL_S") or 5.0)
AUTOSCALER_LATENCY_WINDOW_S = float(env_secret("AUTOSCALER_LATENCY_WINDOW_S") or 60.0)
AUTOSCALER_DEFAULT_STARTUP_S = float(env_secret("AUTOSCALER_DEFAULT_STARTUP_S") or 60.0)
# The portal's history (tenants/usage_series.py, portal/history.py): per-minute rows kept this many days, per-hour
# rows this many; the worker samples the engines' scraped load into them this often.
HISTORY_MINUTES_KEEP_DAYS = env_int("HISTORY_MINUTES_KEEP_DAYS", 35)
HISTORY_HOURS_KEEP_DAYS = env_int("HISTORY_HOURS_KEEP_DAYS", 400)
HISTORY_SAMPLE_EVERY_S = float(env_secret("HISTORY_SAMPLE_EVERY_S") or 10.0)
CELERY_BEAT_SCHEDULE = {
    "reconcile-all-deployments": {
        "task": "serving.tasks.reconcile_all",
        "schedule": RECONCILE_INTERVAL_S,
        "options": {"expires": RECONCILE_INTERVAL_S},
    },
    "autoscale-pools": {
        "task": "serving.tasks.autoscale",
        "schedule": AUTOSCALER_INTERVAL_S,
        "options": {"expires": AUTOSCALER_INTERVAL_S},
    },
    "scrape-engine-metrics": {
        "task": "routing.tasks.scrape_engine_metrics",
        "schedule": 1.0,
        "options": {"expires": 1.0},
    },
    # Budget counters that Redis lost, raised back to the ledger (routing/metering/quota_restore.py, RESTORE_EVERY_S).
    "restore-quota-counters": {
        "task": "routing.tasks.restore_quota_counters",
        "schedule": 15.0,
        "options": {"expires": 15.0},
    },
    # Traces of our own traffic (routing/metering/traffic_trace.py): the router's stream into the database, old rows out.
    "drain-traffic-trace": {
        "task": "routing.tasks.drain_traffic_trace",
        "schedule": 5.0,
        "options": {"expires": 5.0},
    },
    "prune-traffic-trace": {
        "task": "routing.tasks.prune_traffic_trace",
        "schedule": 3600.0,
        "options": {"expires": 3600.0},
    },
    "sample-history": {
        "task": "portal.tasks.sample_history",
        "schedule": HISTORY_SAMPLE_EVERY_S,
        "options": {"expires": HISTORY_SAMPLE_EVERY_S},
    },
    "prune-history": {
        "task": "portal.tasks.prune_history",
        "schedule": 3600.0,
        "options": {"expires": 3600.0},
    },
    # Alerts (alerts/): every rule checked, and deliveries due for a retry sent.
    "evaluate-alerts": {
        "task": "alerts.tasks.evaluate_alerts",
        "schedule": float(env_secret("ALERT_EVALUATE_EVERY_S") or 30.0),
        "options": {"expires": 30.0},
    },
    "deliver-due-alerts": {
        "task": "alerts.tasks.deliver_due",
        "schedule": 10.0,
        "options": {"expires": 10.0},
    },
}

# Local engines (the `local` orchestrator).
ENGINE_PYTHON = Path(env_secret("ENGINE_PYTHON") or BASE_DIR / ".venv-engine" / "bin" / "python")
# `dummy` makes vLLM start from a model folder without weights: no model hub is reachable here.
LOCAL_ENGINE_LOAD_FORMAT = env_secret("LOCAL_ENGINE_LOAD_FORMAT") or "dummy"
# The model an engine without real weights plays, so that agents can work against it. Its answers end by
# themselves after this many tokens (the median agent answer; 0: they run to max_tokens): the simulator's, and
# local vLLM's on dummy weights (a logits processor, serving/engine_plugins/answer_length.py).
DUMMY_ANSWER_LENGTH = env_int("DUMMY_ANSWER_LENGTH", 317)
# The simulator answers a user turn with a tool call only while the conversation holds fewer than this many
# (0: always), so an agent's loop ends; vLLM on dummy weights with the hermes parser calls tools the same way
# (0: never; serving/engine_plugins/tool_calls.py).
SIMULATOR_TOOL_CALLS_PER_CONVERSATION = env_int("SIMULATOR_TOOL_CALLS_PER_CONVERSATION", 2)
ENGINE_HEALTH_TIMEOUT_S = 1.0
# Real vLLM on 2 CPU cores needs about 85-140 s to turn healthy.
ENGINE_STARTUP_TIMEOUT_S = env_int("ENGINE_STARTUP_TIMEOUT_S", 300)
ENGINE_STOP_GRACE_S = env_int("ENGINE_STOP_GRACE_S", 10)
# An engine alive but not answering /health this long (after it was healthy, or after its start-up window) is
# stopped, and restarts with backoff like a crashed one.
ENGINE_HUNG_RESTART_S = env_int("ENGINE_HUNG_RESTART_S", 60)
ENGINE_RESTART_BACKOFF_S = env_int("ENGINE_RESTART_BACKOFF_S", 2)
# A replica chosen for removal gets no new requests and is stopped once its requests end, or after this long.
ENGINE_DRAIN_TIMEOUT_S = env_int("ENGINE_DRAIN_TIMEOUT_S", 600)
# A Kubernetes engine pod told to stop first waits this long (preStop), until routers no longer send it work.
KUBERNETES_PRESTOP_SLEEP_S = env_int("KUBERNETES_PRESTOP_SLEEP_S", 15)
# How long an engine pod stays on a node that stopped answering before it is evicted and made again elsewhere
# (Kubernetes' default is 300 s of idle GPUs).
KUBERNETES_NODE_LOSS_EVICT_S = env_int("KUBERNETES_NODE_LOSS_EVICT_S", 30)
ENGINE_RESTART_BACKOFF_MAX_S = env_int("ENGINE_RESTART_BACKOFF_MAX_S", 300)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if not DEBUG
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "admin:login"
# Where a sign-in without a `next` lands (the portal's, the admin's or the browsable API's form): the portal's home,
# which sends operators to the fleet and everyone else to their teams.
LOGIN_REDIRECT_URL = "portal:home"

# Sign-in throttling for the admin, the portal and the browsable API's forms, and POST /api/auth/token/
# (django-axes): after AXES_FAILURE_LIMIT failed sign-ins for one username from one client address, that pair is
# refused (429) for AXES_COOLOFF_MINUTES; a success clears the count. Attempts are in the database (the admin's
# "Axes" pages; `manage.py axes_reset` unlocks).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "sso.backends.LocalSignInSwitch",  # refuses passwords when LOCAL_SIGN_IN is off
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("AXES_COOLOFF_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "inference_platform.sign_in_limits.lockout_response"
# Behind a TLS proxy the client's address is the one the proxy appends to X-Forwarded-For (TRUSTED_PROXY_COUNT
# proxies in front of the web process, 1 by default); without one it is the connection's own address.
TRUSTED_PROXY_COUNT = env_int("TRUSTED_PROXY_COUNT", 1) if env_bool("BEHIND_TLS_PROXY", False) else 0
AXES_CLIENT_IP_CALLABLE = "inference_platform.sign_in_limits.client_ip"
# Single sign-on's callback carries no password: django-axes neither counts nor locks it out.
AXES_WHITELIST_CALLABLE = "sso.backends.outside_sign_in_limits"

# Single sign-on with OpenID Connect (sso/, mozilla-django-oidc; README "Single sign-on (OpenID Connect)"): off
# unless OIDC_RP_CLIENT_ID is set. The provider's redirect URI is https://<host>/sso/callback/.
OIDC_RP_CLIENT_ID = env_secret("OIDC_RP_CLIENT_ID") or ""
OIDC_RP_CLIENT_SECRET = env_secret("OIDC_RP_CLIENT_SECRET") or ""
OIDC_OP_AUTHORIZATION_ENDPOINT = env_secret("OIDC_OP_AUTHORIZATION_ENDPOINT") or ""
OIDC_OP_TOKEN_ENDPOINT = env_secret("OIDC_OP_TOKEN_ENDPOINT") or ""
OIDC_OP_USER_ENDPOINT = env_secret("OIDC_OP_USER_ENDPOINT") or ""
OIDC_OP_JWKS_ENDPOINT = env_secret("OIDC_OP_JWKS_ENDPOINT") or ""
OIDC_RP_SIGN_ALGO = env_secret("OIDC_RP_SIGN_ALGO") or "RS256"
OIDC_RP_SCOPES = env_secret("OIDC_RP_SCOPES") or "openid email profile"
OIDC_GROUPS_CLAIM = env_secret("OIDC_GROUPS_CLAIM") or "groups"
OIDC_PROVIDER_NAME = env_secret("OIDC_PROVIDER_NAME") or "single sign-on"
OIDC_USE_PKCE = True
OIDC_TIMEOUT = env_int("OIDC_TIMEOUT_S", 10)
OIDC_AUTHENTICATION_CALLBACK_URL = "sso:callback"
# How often a single sign-on session is checked with the provider (sso/refresh.py): a page load then goes there
# with prompt=none and back, and the group rules are applied again to what it says (15 minutes by default). Under a
# minute, pages would bounce through the provider all the time.
OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS = env_int("OIDC_SESSION_REFRESH_S", 15 * 60)
if OIDC_RENEW_ID_TOKEN_EXPIRY_SECONDS < 60:
    raise ImproperlyConfigured("OIDC_SESSION_REFRESH_S must be 60 or more (seconds).")
# Username-and-password sign-in (the portal's, the admin's and the browsable API's forms, POST /api/auth/token/).
LOCAL_SIGN_IN = env_bool("LOCAL_SIGN_IN", True)
if OIDC_RP_CLIENT_ID:
    AUTHENTICATION_BACKENDS.append("sso.backends.OidcBackend")
elif not LOCAL_SIGN_IN:
    raise ImproperlyConfigured(
        "LOCAL_SIGN_IN=off needs single sign-on: set OIDC_RP_CLIENT_ID and the OIDC_OP_*."
    )

# Personal API tokens (django-rest-knox): only a SHA-512 digest is stored; each expires.
REST_KNOX = {
    "AUTH_HEADER_PREFIX": "Bearer",
    "TOKEN_PREFIX": "ipt_",
    "TOKEN_TTL": timedelta(hours=env_int("PERSONAL_TOKEN_TTL_HOURS", 24 * 30)),
    "TOKEN_LIMIT_PER_USER": env_int("PERSONAL_TOKEN_LIMIT", 20),
    "AUTO_REFRESH": False,
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Bearer first, so an anonymous request is told 401 with a WWW-Authenticate header.
        "tenants.api.authentication.PersonalTokenAuthentication",
        "tenants.api.authentication.ApiKeyAuthentication",
        "tenants.api.authentication.ActiveTenantSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["inference_platform.api_query.StrictFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "inference_platform.api_query.StrictLimitOffsetPagination",
    # JSON only: form encodings carry no types (a boolean "0", a nested list flattened) and the schema then
    # promises what the parser cannot keep.
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "PAGE_SIZE": 100,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "inference_platform.api_errors.exception_handler",
    # POST /api/auth/token/ per client address (the `login` scope), on top of django-axes.
    "DEFAULT_THROTTLE_RATES": {"login": env_secret("API_LOGIN_RATE") or "10/minute"},
    # 0, not DRF's default None, which would key the throttle on a client-written X-Forwarded-For.
    "NUM_PROXIES": TRUSTED_PROXY_COUNT,
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Inference platform provisioning API",
    "DESCRIPTION": "Tenants, teams, members, API keys, quotas, prices, model deployments, routing policies and usage.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI served from our own static files: a self-hosted platform needs no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # One name for the priority classes, used by tenants' ceilings, teams, keys and usage records alike.
    "ENUM_NAME_OVERRIDES": {
        "PriorityClassEnum": "tenants.models.PriorityClass",
        "BudgetPeriodEnum": "tenants.models.BudgetPeriod",
    },
}

# HTTPS hardening. On by default whenever DEBUG is off; each can be relaxed explicitly.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("BEHIND_TLS_PROXY", False) else None
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # The level first, so a reader of the output (devstack's console filter, a log shipper) can tell warnings.
    "formatters": {"levelled": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "levelled"}},
    "root": {"handlers": ["console"], "level": env_secret("LOG_LEVEL") or "INFO"},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "httpx": {"level": "WARNING"},  # one line per engine health probe otherwise
        "httpcore": {"level": "WARNING"},
    },
}

# The router (/v1 data plane).
ROUTER_MAX_BODY_BYTES = env_int("ROUTER_MAX_BODY_BYTES", 32 * 1024 * 1024)
ROUTER_MAX_MESSAGES = env_int("ROUTER_MAX_MESSAGES", 10_000)
ROUTER_MAX_ATTEMPTS = env_int(
    "ROUTER_MAX_ATTEMPTS", 3
)  # engines tried before giving up (before the first byte)
ROUTER_CONFIG_POLL_SECONDS = float(env_secret("ROUTER_CONFIG_POLL_SECONDS") or 1.0)
# How often each replica trades its own load per endpoint with the other replicas (and rereads the engines'
# scraped load): a burst of sub-agents comes within a fraction of a second.
ROUTER_LOAD_SHARE_SECONDS = float(env_secret("ROUTER_LOAD_SHARE_SECONDS") or 0.1)
ROUTER_SNAPSHOT_MAX_AGE = float(env_secret("ROUTER_SNAPSHOT_MAX_AGE") or 10.0)
# Flow control's fair share counts each tenant's (and team's) work over roughly this many seconds: its decay time
# constant (routing/scheduling/flow.py).
ROUTER_FAIR_SHARE_WINDOW_S = float(env_secret("ROUTER_FAIR_SHARE_WINDOW_S") or 60.0)
ROUTER_SPECULATIVE_TTL_SECONDS = float(env_secret("ROUTER_SPECULATIVE_TTL_SECONDS") or 3.0)
# A precise lookup Redis has not answered by then is routed on the replica's own record instead (a guard
# against Redis stalls; a lookup normally takes well under a millisecond plus the network's round trip).
ROUTER_INDEX_LOOKUP_TIMEOUT_SECONDS = float(env_secret("ROUTER_INDEX_LOOKUP_TIMEOUT_SECONDS") or 0.01)
ROUTER_APPROX_BLOCKS_PER_ENDPOINT = env_int("ROUTER_APPROX_BLOCKS_PER_ENDPOINT", 4096)
ROUTER_DECISION_LOG_SAMPLE = float(env_secret("ROUTER_DECISION_LOG_SAMPLE") or 0.01)
ROUTER_REDIS_MAX_CONNECTIONS = env_int("ROUTER_REDIS_MAX_CONNECTIONS", 256)
ROUTER_CONNECT_TIMEOUT = float(env_secret("ROUTER_CONNECT_TIMEOUT") or 2.0)
# Net new container objects between two young-generation garbage collections (Python's default is 700).
ROUTER_GC_THRESHOLD = env_int("ROUTER_GC_THRESHOLD", 50_000)
# Keys are refused (503) once the snapshot could not be reloaded for this long (Postgres and Redis both down).
ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS = float(env_secret("ROUTER_SNAPSHOT_FAIL_CLOSED_SECONDS") or 60.0)
# Requests one replica serves at once; past it, a 503 with Retry-After.
ROUTER_MAX_CONNECTIONS = env_int("ROUTER_MAX_CONNECTIONS", 4096)
ROUTER_MAX_CHOICES = env_int("ROUTER_MAX_CHOICES", 8)  # the largest `n`
# A request's stop sequences (`stop`, Anthropic's `stop_sequences`): how many, and their UTF-8 bytes in all; past
# either, a 400 before any engine is asked. OpenAI documents 4, vLLM sets no limit: these leave room for any agent.
ROUTER_MAX_STOP_SEQUENCES = env_int("ROUTER_MAX_STOP_SEQUENCES", 64)
ROUTER_MAX_STOP_BYTES = env_int("ROUTER_MAX_STOP_BYTES", 4096)
# What an answer may make the router hold: an engine's whole (unstreamed) answer, one event of a stream, and the
# prompt logprobs a request may ask for (prompt tokens x (logprobs + 1) entries, `prompt_logprobs` or a
# completion's `echo` with `logprobs`: some 70 bytes of answer each).
ROUTER_MAX_ANSWER_BYTES = env_int("ROUTER_MAX_ANSWER_BYTES", 64 * 1024 * 1024)
ROUTER_MAX_EVENT_BYTES = env_int("ROUTER_MAX_EVENT_BYTES", 8 * 1024 * 1024)
ROUTER_MAX_PROMPT_LOGPROB_ENTRIES = env_int("ROUTER_MAX_PROMPT_LOGPROB_ENTRIES", 262_144)
# Prompts waiting to be tokenized, and how long one waits; past either, the request is routed on load alone.
ROUTER_TOKENIZE_QUEUE = env_int("ROUTER_TOKENIZE_QUEUE", 64)
ROUTER_TOKENIZE_WAIT_SECONDS = float(env_secret("ROUTER_TOKENIZE_WAIT_SECONDS") or 2.0)
# Requests whose JSON is at least TOKENIZE_POOL_MIN_BYTES long are tokenized in TOKENIZE_PROCESSES worker processes
# (routing/rendering/tokenize_pool.py), so a large prompt does not stop the replica's streams; smaller ones on the router's
# tokenizing thread, where they cost less. 0 processes: all on the thread.
ROUTER_TOKENIZE_PROCESSES = env_int("ROUTER_TOKENIZE_PROCESSES", 2)
ROUTER_TOKENIZE_POOL_MIN_BYTES = env_int("ROUTER_TOKENIZE_POOL_MIN_BYTES", 16 * 1024)
# Token ids of large pieces of rendered text, shared by every replica and worker through Redis
# (routing/rendering/shared_tokens.py): a piece of at least MIN_PIECE_CHARS, asked for when a prompt has MIN_REQUEST_CHARS of
# text the replica has not tokenised, kept TTL seconds after it was written (4 bytes a token in Redis).
ROUTER_SHARED_TOKENS = env_bool("ROUTER_SHARED_TOKENS", True)
ROUTER_SHARED_TOKENS_MIN_PIECE_CHARS = env_int("ROUTER_SHARED_TOKENS_MIN_PIECE_CHARS", 256)
ROUTER_SHARED_TOKENS_MIN_REQUEST_CHARS = env_int("ROUTER_SHARED_TOKENS_MIN_REQUEST_CHARS", 4096)
ROUTER_SHARED_TOKENS_TTL_SECONDS = env_int("ROUTER_SHARED_TOKENS_TTL_SECONDS", 6 * 3600)
# Traces (routing/server/tracing.py): OTLP/HTTP (protobuf) to this URL, the collector's /v1/traces; empty: off, at no
# cost. By default the standard OpenTelemetry variables' endpoint. ROUTER_TRACES_SAMPLE_RATIO of the requests are
# kept, whatever a client's `traceparent` asks (its trace id is continued); with FOLLOW_CLIENT_SAMPLING, a client's
# sampled flag decides for its own request. The exporter reads OTEL_EXPORTER_OTLP_HEADERS (or _TRACES_HEADERS)
# itself.
_OTLP_BASE = (env_secret("OTEL_EXPORTER_OTLP_ENDPOINT") or "").rstrip("/")
ROUTER_TRACES_ENDPOINT = (
    ""
    if env_bool("OTEL_SDK_DISABLED", False)
    else env_secret("ROUTER_TRACES_ENDPOINT")
    or env_secret("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    or (f"{_OTLP_BASE}/v1/traces" if _OTLP_BASE else "")
)
ROUTER_TRACES_SAMPLE_RATIO = float(env_secret("ROUTER_TRACES_SAMPLE_RATIO") or 1.0)
if not 0.0 <= ROUTER_TRACES_SAMPLE_RATIO <= 1.0:
    raise ImproperlyConfigured("ROUTER_TRACES_SAMPLE_RATIO must be between 0 and 1")
ROUTER_TRACES_SERVICE_NAME = env_secret("OTEL_SERVICE_NAME") or "inference-router"
ROUTER_TRACES_FOLLOW_CLIENT_SAMPLING = env_bool("ROUTER_TRACES_FOLLOW_CLIENT_SAMPLING", False)
# What one span may hold (the SDK's SpanLimits, under the standard variables' names): attributes, and characters of
# an attribute's string value (the SDK sets no length limit of its own).
ROUTER_TRACES_MAX_ATTRIBUTES = env_int("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", 64)
ROUTER_TRACES_MAX_ATTRIBUTE_LENGTH = env_int("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", 256)
if min(ROUTER_TRACES_MAX_ATTRIBUTES, ROUTER_TRACES_MAX_ATTRIBUTE_LENGTH) < 1:
    raise ImproperlyConfigured("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT and _VALUE_LENGTH_LIMIT must be at least 1")
# Traces of our own traffic for the planner (routing/metering/traffic_trace.py, docs/planner.md): RATIO of the requests
# (0: none, at no cost) leave an entry on a Redis stream capped at STREAM_MAXLEN entries, drained by the worker into
# the database and kept KEEP_DAYS. Block keys and sessions are stored as keyed hashes under SECRET (blank: derived
# from SECRET_KEY), so they cannot be matched against the keys of a known text.
ROUTER_TRAFFIC_TRACE_RATIO = float(env_secret("ROUTER_TRAFFIC_TRACE_RATIO") or 0.0)
if not 0.0 <= ROUTER_TRAFFIC_TRACE_RATIO <= 1.0:
    raise ImproperlyConfigured("ROUTER_TRAFFIC_TRACE_RATIO must be between 0 and 1")
ROUTER_TRAFFIC_TRACE_SECRET = env_secret("ROUTER_TRAFFIC_TRACE_SECRET") or ""
ROUTER_TRAFFIC_TRACE_STREAM = env_secret("ROUTER_TRAFFIC_TRACE_STREAM") or "traffic:trace"
ROUTER_TRAFFIC_TRACE_STREAM_MAXLEN = env_int("ROUTER_TRAFFIC_TRACE_STREAM_MAXLEN", 10_000)
ROUTER_TRAFFIC_TRACE_KEEP_DAYS = env_int("ROUTER_TRAFFIC_TRACE_KEEP_DAYS", 14)
# What-if runs (planner/whatif.py). At most MAX_RUNNING are pending or running at once, platform-wide (a run replays
# every tenant's traffic and only operators start one); past it a new one is refused with a 429. A run holds at
# most MAX_BLOCKS prompt block ids, every replayed copy counted (about 150 bytes each at the peak, so ~1.5 GB of
# worker memory at the default). A run still pending or running TIMEOUT_S after it was created is taken as lost
# (its task or worker gone): the next run started fails it and takes its slot.
PLANNER_WHATIF_MAX_RUNNING = env_int("PLANNER_WHATIF_MAX_RUNNING", 2)
if PLANNER_WHATIF_MAX_RUNNING < 1:
    raise ImproperlyConfigured("PLANNER_WHATIF_MAX_RUNNING must be at least 1")
PLANNER_WHATIF_MAX_BLOCKS = env_int("PLANNER_WHATIF_MAX_BLOCKS", 10_000_000)
PLANNER_WHATIF_TIMEOUT_S = env_int("PLANNER_WHATIF_TIMEOUT_S", 3600)
# /v1/messages/count_tokens: its largest body (a 413 past it), and how long it waits for its count (then a 503).
# Each call counts against its key's and team's requests per minute, as a generation request does.
ROUTER_COUNT_TOKENS_MAX_BYTES = env_int("ROUTER_COUNT_TOKENS_MAX_BYTES", 4 * 1024 * 1024)
ROUTER_COUNT_TOKENS_WAIT_SECONDS = float(env_secret("ROUTER_COUNT_TOKENS_WAIT_SECONDS") or 30.0)
# Work before admission (routing/server/intake.py). A request body must arrive whole within BODY_TIMEOUT seconds and, past
# its first 5 seconds, at BODY_MIN_BYTES_PER_SECOND on average (else a 408 and the connection is closed). One key
# may have at most INTAKE_PER_KEY requests on a replica whose bodies are still arriving (else a 429). A client that
# takes nothing of its answer for SEND_TIMEOUT seconds is cut off, as one that hung up.
ROUTER_BODY_TIMEOUT_SECONDS = float(env_secret("ROUTER_BODY_TIMEOUT_SECONDS") or 60.0)
ROUTER_BODY_MIN_BYTES_PER_SECOND = env_int("ROUTER_BODY_MIN_BYTES_PER_SECOND", 16 * 1024)
ROUTER_INTAKE_PER_KEY = env_int("ROUTER_INTAKE_PER_KEY", 64)
ROUTER_SEND_TIMEOUT_SECONDS = float(env_secret("ROUTER_SEND_TIMEOUT_SECONDS") or 30.0)
# Served with `--http routing.server.http_server:LimitedHttpToolsProtocol`: a request's headers must be at most
# MAX_HEADER_BYTES (else a 431) and complete within HEADER_TIMEOUT seconds of their first byte (else a 408).
ROUTER_MAX_HEADER_BYTES = env_int("ROUTER_MAX_HEADER_BYTES", 64 * 1024)
ROUTER_HEADER_TIMEOUT_SECONDS = float(env_secret("ROUTER_HEADER_TIMEOUT_SECONDS") or 10.0)
# The router's /metrics answers only `Authorization: Bearer <ROUTER_METRICS_TOKEN>` (a 401 otherwise); with none
# set it is not served. A development stack (DEBUG) makes one in the state folder.
ROUTER_METRICS_TOKEN = env_secret("ROUTER_METRICS_TOKEN") or (
    local_secret(STATE_DIR / "router_metrics_token") if DEBUG else ""
)
# The web process's /metrics/platform (deployments, endpoints, usage by tenant) and /metrics/engines (the engines
# as Prometheus HTTP service discovery targets) answer only this bearer token; blank: the router's.
PLATFORM_METRICS_TOKEN = env_secret("PLATFORM_METRICS_TOKEN") or ROUTER_METRICS_TOKEN
# The per-deployment engine API keys are HMACs under this secret (serving/engine_keys.py); the router and the
# worker must share it. Blank: SECRET_KEY.
ENGINE_KEY_SECRET = env_secret("ENGINE_KEY_SECRET") or ""
# Usage Redis cannot take goes to a durable journal in this directory (give each router replica a persistent
# volume of its own), replayed once Redis answers; past MAX_BYTES, or when the disk refuses, new work gets a 503.
ROUTER_USAGE_JOURNAL_DIR = env_secret("ROUTER_USAGE_JOURNAL_DIR") or str(STATE_DIR / "usage-journal")
ROUTER_USAGE_JOURNAL_MAX_BYTES = env_int("ROUTER_USAGE_JOURNAL_MAX_BYTES", 1 << 30)
ROUTER_USAGE_REDIS_TIMEOUT = float(env_secret("ROUTER_USAGE_REDIS_TIMEOUT") or 5.0)
# A request's concurrency slot is a lease renewed while it runs: a replica that dies frees its slots this late.
ROUTER_CONCURRENCY_LEASE_SECONDS = float(env_secret("ROUTER_CONCURRENCY_LEASE_SECONDS") or 30.0)

# Usage metering: the router's events stream through Redis into the ledger (tenants/usage_stream.py).
USAGE_STREAM = env_secret("USAGE_STREAM") or "usage:events"
USAGE_DEAD_LETTER_STREAM = env_secret("USAGE_DEAD_LETTER_STREAM") or "usage:dead"
USAGE_STREAM_MAXLEN = env_int("USAGE_STREAM_MAXLEN", 1_000_000)
USAGE_VISIBILITY_TIMEOUT_MS = env_int("USAGE_VISIBILITY_TIMEOUT_MS", 60_000)
USAGE_INGEST_BATCH_SIZE = env_int("USAGE_INGEST_BATCH_SIZE", 500)
# One ingest run drains the stream for at most this long; beat starts the next every two seconds.
USAGE_INGEST_MAX_SECONDS = float(env_secret("USAGE_INGEST_MAX_SECONDS") or 10.0)
USAGE_DEFAULT_CURRENCY = env_secret("USAGE_DEFAULT_CURRENCY") or "USD"

# Alerts (alerts/; README "Alerts"). E-mail goes through Django's e-mail backend: SMTP at EMAIL_HOST.
EMAIL_BACKEND = env_secret("EMAIL_BACKEND") or "django.core.mail.backends.smtp.EmailBackend"
EMAIL_HOST = env_secret("EMAIL_HOST") or "localhost"
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_secret("EMAIL_HOST_USER") or ""
EMAIL_HOST_PASSWORD = env_secret("EMAIL_HOST_PASSWORD") or ""
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10)
DEFAULT_FROM_EMAIL = env_secret("DEFAULT_FROM_EMAIL") or "alerts@localhost"
ALERT_EMAIL_FROM = env_secret("ALERT_EMAIL_FROM") or DEFAULT_FROM_EMAIL
# A failed delivery is retried after BACKOFF_S, doubling each time (at most an hour), ATTEMPTS times in all.
ALERT_DELIVERY_ATTEMPTS = env_int("ALERT_DELIVERY_ATTEMPTS", 6)
ALERT_DELIVERY_BACKOFF_S = env_int("ALERT_DELIVERY_BACKOFF_S", 30)
# One webhook attempt's whole deadline (connect, headers and the first bytes of the body), at most 60 s.
ALERT_WEBHOOK_TIMEOUT_S = float(env_secret("ALERT_WEBHOOK_TIMEOUT_S") or 10.0)
# A tenant has at most this many alert rules and destinations (the operators' own are not counted).
ALERT_MAX_RULES_PER_TENANT = env_int("ALERT_MAX_RULES_PER_TENANT", 50)
ALERT_MAX_DESTINATIONS_PER_TENANT = env_int("ALERT_MAX_DESTINATIONS_PER_TENANT", 20)
# A tenant's webhooks may reach only public addresses unless this is on; the operators' may reach any.
ALERT_WEBHOOK_ALLOW_PRIVATE = env_bool("ALERT_WEBHOOK_ALLOW_PRIVATE", False)
# The routers' /metrics URLs (comma-separated), read for their usage journals (with ROUTER_METRICS_TOKEN).
ALERT_ROUTER_METRICS_URLS = env_list("ALERT_ROUTER_METRICS_URLS", [])
# The portal's address, for links in alerts (e.g. https://platform.example.com). Blank: no link.
ALERT_PORTAL_URL = env_secret("ALERT_PORTAL_URL") or ""

# Kubernetes (the `kubernetes` orchestrator; see README "Kubernetes").
# Cluster access: the pod's service account when in a cluster, else a kubeconfig file and context.
KUBERNETES_IN_CLUSTER = env_bool("KUBERNETES_IN_CLUSTER", False)
# Explicit only (not $KUBECONFIG): the sweep deletes our labelled objects that no deployment here wants.
KUBERNETES_KUBECONFIG = env_secret("KUBERNETES_KUBECONFIG") or ""
KUBERNETES_CONTEXT = env_secret("KUBERNETES_CONTEXT") or None
# Where deployments without a namespace of their own go, and every namespace the orchestrator may touch.
KUBERNETES_NAMESPACE = env_secret("KUBERNETES_NAMESPACE") or "inference"
KUBERNETES_NAMESPACES = env_list("KUBERNETES_NAMESPACES", [KUBERNETES_NAMESPACE])
# Where the platform's own pods (router, worker, KV-event ingester) run: engine NetworkPolicies admit them.
KUBERNETES_PLATFORM_NAMESPACE = env_secret("KUBERNETES_PLATFORM_NAMESPACE") or "inference-platform"
KUBERNETES_FIELD_MANAGER = "inference-platform"
KUBERNETES_ENGINE_IMAGE = env_secret("KUBERNETES_ENGINE_IMAGE") or "vllm/vllm-openai:latest"
# The platform's own image: engines of kind `sim` run the simulator from it.
KUBERNETES_PLATFORM_IMAGE = env_secret("KUBERNETES_PLATFORM_IMAGE") or "inference-platform:latest"
KUBERNETES_ACCELERATOR_LABEL = env_secret("KUBERNETES_ACCELERATOR_LABEL") or "nvidia.com/gpu.product"
KUBERNETES_SHM_SIZE = env_secret("KUBERNETES_SHM_SIZE") or "16Gi"
# A Secret with an HF_TOKEN key for gated models (optional in the pod: absent means no token).
KUBERNETES_HF_TOKEN_SECRET = env_secret("KUBERNETES_HF_TOKEN_SECRET") or ""
# An InferencePool per deployment for a Gateway API inference gateway; its endpoint picker as service:port.
KUBERNETES_INFERENCE_POOL = env_bool("KUBERNETES_INFERENCE_POOL", False)
KUBERNETES_ENDPOINT_PICKER = env_secret("KUBERNETES_ENDPOINT_PICKER") or ""
# API calls answered 409 (conflict), 429 or 5xx are retried this often within a reconcile, backing off.
KUBERNETES_API_RETRIES = env_int("KUBERNETES_API_RETRIES", 3)
KUBERNETES_API_BACKOFF_S = float(env_secret("KUBERNETES_API_BACKOFF_S") or 0.5)
KUBERNETES_API_TIMEOUT_S = float(env_secret("KUBERNETES_API_TIMEOUT_S") or 10.0)

# What engines may reach on a tenant's behalf (README "Security").
# Engine pods send only to the cluster DNS and to the other pods of their own deployment; these CIDRs are added
# for what else they need, such as a model mirror or an HTTP proxy for the weights (the Hugging Face hub is not
# reachable otherwise). Link-local addresses (cloud metadata) stay refused even inside them.
KUBERNETES_ENGINE_EGRESS_CIDRS = env_list("KUBERNETES_ENGINE_EGRESS_CIDRS", [])
# Hosts a vLLM engine of a model that takes images, audio or video may fetch media URLs from (vLLM's
# --allowed-media-domains). Empty: none at all, so media must come inline as data: URLs.
ENGINE_ALLOWED_MEDIA_DOMAINS = env_list("ENGINE_ALLOWED_MEDIA_DOMAINS", [])
# Where vLLM engines export their own request spans (vLLM's --otlp-traces-endpoint, OTLP/gRPC by default): the
# router passes each request's `traceparent`, so they join its trace. Empty: not passed. The simulator takes no
# such flag.
ENGINE_TRACES_ENDPOINT = env_secret("ENGINE_TRACES_ENDPOINT") or ""

# The portal's live-traffic WebSocket is served by the web process (inference_platform/web_asgi.py), beside the
# portal's pages and behind the same session cookie; never by the router. Empty: the page's own host and port;
# ":PORT": the page's host on that port; or a full ws:// or wss:// URL.
PORTAL_LIVE_WEBSOCKET_URL = env_secret("PORTAL_LIVE_WEBSOCKET_URL") or ""
