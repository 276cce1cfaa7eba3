"""The FastAPI app: thin routes over a JobStore, optional Kubernetes auth, metrics, the dashboard.

Routes are plain (sync) functions: the stores do blocking HTTP with short timeouts, and FastAPI
runs sync routes in its thread pool, so one slow trainer does not stall other requests.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime, and
# they name a type alias local to create_app.
import ipaddress
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles

from lorarl.api.resource import GROUP, PLURAL
from lorarl.api.spec.k8s import DNS1123_LABEL, DNS1123_SUBDOMAIN
from lorarl.server.auth import ALL_NAMESPACES, Authorizer, AuthUnavailable, Unauthenticated, User
from lorarl.server.models import (
    ErrorDetail,
    Health,
    JobDetail,
    JobList,
    JobMetrics,
    JobSamples,
    JobSummary,
)
from lorarl.server.names import NAME_MAX, NAMESPACE_MAX, name_problem, namespace_problem
from lorarl.server.stores.base import JobNotFound, JobStore, StoreUnavailable
from lorarl.server.telemetry import CONTENT_TYPE, Telemetry

DASHBOARD_DIR = Path(__file__).parent / "dashboard"
_CHALLENGE = {"WWW-Authenticate": "Bearer"}
METRICS_PATH = "/metrics"
# The dashboard's pages load scripts, styles and data from this server only (uPlot is vendored):
# an injected `<script>` or a request to another host is refused by the browser itself.
DASHBOARD_CSP = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)
DASHBOARD_HEADERS = {
    "Content-Security-Policy": DASHBOARD_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# The grammar is documented here and enforced by `_job_ref`/`_check_namespace`, which run before
# the caller's token is reviewed: a malformed name never reaches a store or the API server.
_LABEL_SCHEMA = {"pattern": DNS1123_LABEL, "maxLength": NAMESPACE_MAX}
_SUBDOMAIN_SCHEMA = {"pattern": DNS1123_SUBDOMAIN, "maxLength": NAME_MAX}
Namespace = Annotated[
    str,
    PathParam(
        description="Namespace (`local` for local runs): a DNS-1123 label.",
        examples=["local"],
        json_schema_extra=_LABEL_SCHEMA,
    ),
]
Name = Annotated[
    str,
    PathParam(
        description="Job name: a DNS-1123 subdomain.",
        examples=["quickstart"],
        json_schema_extra=_SUBDOMAIN_SCHEMA,
    ),
]
NamespaceFilter = Annotated[
    str | None,
    Query(description="Only this namespace (a DNS-1123 label).", json_schema_extra=_LABEL_SCHEMA),
]


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise HTTPException(422, problem)


def _job_ref(namespace: Namespace, name: Name) -> tuple[str, str]:
    """(namespace, name), or a 422 naming the bad parameter."""
    _refuse(namespace_problem(namespace))
    _refuse(name_problem(name))
    return namespace, name


def _namespace_filter(namespace: NamespaceFilter = None) -> str | None:
    if namespace is not None:
        _refuse(namespace_problem(namespace))
    return namespace


JobRef = Annotated[tuple[str, str], Depends(_job_ref)]


def _caller_dependency(auth: Authorizer | None) -> Callable[..., User | None]:
    """A dependency yielding the authenticated caller (None when the server runs without auth)."""
    if auth is None:

        def anonymous() -> None:
            return None

        return anonymous

    bearer = HTTPBearer(auto_error=False, description="A Kubernetes bearer token.")

    def caller(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> User:
        if credentials is None or not credentials.credentials:
            raise HTTPException(
                401, "missing bearer token (Authorization: Bearer <token>)", headers=_CHALLENGE
            )
        try:
            return auth.authenticate(credentials.credentials)
        except Unauthenticated as exc:
            raise HTTPException(401, str(exc), headers=_CHALLENGE) from exc
        except AuthUnavailable as exc:
            raise HTTPException(503, str(exc)) from exc

    return caller


def _check(auth: Authorizer | None, user: User | None, verb: str, namespace: str) -> bool:
    if auth is None or user is None:
        return True
    try:
        return auth.allowed(user, verb, namespace)
    except AuthUnavailable as exc:
        raise HTTPException(503, str(exc)) from exc


def _require(auth: Authorizer | None, user: User | None, verb: str, namespace: str) -> None:
    if not _check(auth, user, verb, namespace):
        who = user.username if user else "anonymous"
        raise HTTPException(
            403, f"user {who!r} may not {verb} {PLURAL}.{GROUP} in namespace {namespace!r}"
        )


def loopback_host(host_header: str | None, server_port: int | None) -> bool:
    """Whether a Host header names this server on a loopback address: `localhost`, `127.x.y.z`
    or `[::1]`, with no port or the port the server listens on. A web page whose own name an
    attacker has pointed at 127.0.0.1 (DNS rebinding) sends its own name here, and is refused."""
    if not host_header:
        return False
    host, port = host_header.strip().lower(), None
    if host.startswith("["):  # [v6] or [v6]:port
        end = host.find("]")
        if end < 0:
            return False
        host, rest = host[1:end], host[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                return False
            port = rest[1:]
    elif host.count(":") == 1:
        host, port = host.split(":")
    elif ":" in host:
        return False  # an unbracketed IPv6 literal is not a valid Host
    if port is not None and (
        not port.isdigit() or (server_port is not None and int(port) != server_port)
    ):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route_template(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", None) or "<unmatched>"


def create_app(
    store: JobStore, *, auth: Authorizer | None = None, loopback_only: bool = False
) -> FastAPI:
    """The status API over `store`; with `auth`, every /v1 call needs a reviewed bearer token.

    `loopback_only` (the local server `lorarl run --local` starts): every request's Host header
    must name a loopback address or `localhost` (see `loopback_host`), else 421. The in-cluster
    server is reached by its Service name and authenticates every call, so it leaves this off.
    No route sends CORS headers: a page on another origin cannot read the answers."""
    app = FastAPI(
        title="lorarl status API",
        version="v1",
        description="LoRARLJobs, their status and step history; the dashboard lives at `/`.",
    )
    telemetry = Telemetry(store)
    caller = _caller_dependency(auth)
    Caller = Annotated[User | None, Depends(caller)]

    errors: dict[int | str, dict[str, Any]] = {503: {"model": ErrorDetail}}
    if auth is not None:
        errors |= {401: {"model": ErrorDetail}, 403: {"model": ErrorDetail}}
    metrics_responses: dict[int | str, dict[str, Any]] = {
        200: {
            "content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
            "description": "Prometheus text format.",
        },
        **errors,
    }
    errors[422] = {"model": ErrorDetail}
    with_404 = errors | {404: {"model": ErrorDetail}}

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        start = time.perf_counter()
        response = await call_next(request)
        telemetry.observe(
            _route_template(request),
            request.method,
            response.status_code,
            time.perf_counter() - start,
        )
        return response

    @app.middleware("http")
    async def dashboard_headers(request: Request, call_next):
        response = await call_next(request)
        if request.url.path == "/" or request.url.path.startswith("/dashboard/"):
            response.headers.update(DASHBOARD_HEADERS)  # not /docs: FastAPI's docs use a CDN
        return response

    if loopback_only:

        @app.middleware("http")  # added last, so it runs first
        async def loopback_host_only(request: Request, call_next):
            server = request.scope.get("server")
            port = server[1] if server and len(server) > 1 else None
            if not loopback_host(request.headers.get("host"), port):
                return JSONResponse(
                    {"detail": "Host must be localhost or a loopback address (this API is local)"},
                    status_code=421,
                )
            return await call_next(request)

    @app.exception_handler(JobNotFound)
    def not_found(_: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(StoreUnavailable)
    def unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.get("/v1/jobs", response_model=JobList, responses=errors, tags=["jobs"])
    def list_jobs(
        namespace: Annotated[str | None, Depends(_namespace_filter)], user: Caller
    ) -> JobList:
        """Jobs the caller may list; never another namespace's jobs."""
        if namespace is not None:
            _require(auth, user, "list", namespace)
            return JobList(items=store.list_jobs([namespace]))
        if _check(auth, user, "list", ALL_NAMESPACES):
            return JobList(items=store.list_jobs(None))
        rows = store.list_jobs(None)
        visible = {ns for ns in {r.namespace for r in rows} if _check(auth, user, "list", ns)}
        items: list[JobSummary] = [r for r in rows if r.namespace in visible]
        return JobList(items=items)

    @app.get(
        "/v1/jobs/{namespace}/{name}", response_model=JobDetail, responses=with_404, tags=["jobs"]
    )
    def get_job(ref: JobRef, user: Caller) -> JobDetail:
        """Spec summary, status and conditions of one job."""
        namespace, name = ref
        _require(auth, user, "get", namespace)
        return store.get_job(namespace, name)

    @app.get(
        "/v1/jobs/{namespace}/{name}/metrics",
        response_model=JobMetrics,
        responses=with_404,
        tags=["jobs"],
    )
    def get_metrics(ref: JobRef, user: Caller) -> JobMetrics:
        """The step history: reward, KL, entropy, sync seconds, tokens/s per step."""
        namespace, name = ref
        _require(auth, user, "get", namespace)
        return store.get_metrics(namespace, name)

    @app.get(
        "/v1/jobs/{namespace}/{name}/samples",
        response_model=JobSamples,
        responses=with_404,
        tags=["jobs"],
    )
    def get_samples(ref: JobRef, user: Caller) -> JobSamples:
        """The newest sample completions with their rewards and advantages
        (training.samplesInterval)."""
        namespace, name = ref
        _require(auth, user, "get", namespace)
        return store.get_samples(namespace, name)

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz() -> Health:
        return Health()

    @app.get(
        METRICS_PATH,
        tags=["ops"],
        response_class=Response,
        responses=metrics_responses,
    )
    def metrics(user: Caller) -> Response:
        """Requests by route and jobs by phase. With auth, only for callers RBAC lets `get` the
        non-resource URL /metrics (as Prometheus' own ClusterRole usually does)."""
        if auth is not None and user is not None:
            try:
                allowed = auth.allowed_url(user, "get", METRICS_PATH)
            except AuthUnavailable as exc:
                raise HTTPException(503, str(exc)) from exc
            if not allowed:
                raise HTTPException(403, f"user {user.username!r} may not get {METRICS_PATH}")
        return Response(telemetry.render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard", StaticFiles(directory=DASHBOARD_DIR), name="dashboard")
    return app
