"""One ASGI app serving E2B's REST API and the in-sandbox daemon (envd) API on one port.

envd requests carry ``E2b-Sandbox-Id``; they are routed by that header, so one server serves every sandbox
(point the SDK at it with ``E2B_API_URL`` and ``E2B_SANDBOX_URL``, or ``api_url=`` / ``sandbox_url=``).
Every error is E2B-shaped JSON, ``{"code": <http status>, "message": "<what was wrong; what is valid>"}``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import json
import logging
import zlib
from typing import Any
from urllib.parse import parse_qsl

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .envd import FilesystemService, ProcessService
from .link import AgentError, AgentGone
from .runtime import BACKEND_KEY, ENVD_VERSION, MAX_TIMEOUT, ApiError, Manager, SandboxRec

log = logging.getLogger("rlk3.sandbox")
CLIENT_ID = "rlk3-local"
ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


class TooLarge(Exception):
    pass


# ------------------------------------------------------------------------------------------- validation
async def json_body(request: Request, *, required: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise ApiError(400, "request body is empty; send a JSON object")
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def field(body: dict, name: str, kind: type | tuple, default: Any = None, *, what: str = "") -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        value = object()  # JSON true is not an integer here
    if not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ApiError(400, f"field '{name}' must be {what or names}, got {json.dumps(value, default=str)[:80]}")
    return value


def timeout_field(body: dict, name: str = "timeout", default: int | None = None) -> int | None:
    value = field(body, name, int, default, what=f"an integer number of seconds between 0 and {MAX_TIMEOUT}")
    if value is not None and not 0 <= value <= MAX_TIMEOUT:
        raise ApiError(400, f"field '{name}' must be between 0 and {MAX_TIMEOUT} seconds, got {value}")
    return value


def str_map(body: dict, name: str) -> dict[str, str]:
    value = field(body, name, dict, {}, what="an object of string values")
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        raise ApiError(400, f"field '{name}' must map strings to strings; bad keys: {bad[:5]}")
    return value


def sandbox_json(rec: SandboxRec) -> dict:
    return {
        "templateID": rec.template_id,
        "sandboxID": rec.id,
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "alias": rec.alias,
    }


def detail_json(rec: SandboxRec) -> dict:
    lim = rec.limits
    d = {
        **sandbox_json(rec),
        "startedAt": iso(rec.started_at),
        "endAt": iso(rec.end_at),
        "cpuCount": max(1, round(lim["cpu_count"])),
        "memoryMB": lim["memory_mb"],
        "diskSizeMB": lim["disk_mb"],
        "state": rec.state,
        "metadata": rec.metadata,
        "allowInternetAccess": False,
        "lifecycle": {"onTimeout": rec.on_timeout, "autoResume": rec.auto_resume},
    }
    if rec.state == "paused":
        d["pauseMode"] = "filesystem" if rec.pause_kind == "filesystem" else "full"
    return d


# ------------------------------------------------------------------------------------------- REST
def build_app(manager: Manager, *, api_key: str | None = None, max_upload_mb: int = 100) -> Any:
    m = manager
    max_upload = max_upload_mb << 20

    def sid_of(request: Request) -> str:
        return request.path_params["sid"]

    async def create(request: Request) -> Response:
        body = await json_body(request, required=True)
        template = field(body, "templateID", str, what="a template name or snapshot ID string")
        if not template:
            raise ApiError(400, 'field \'templateID\' is required (e.g. "base", "python", "node" or a snapshot ID)')
        timeout = timeout_field(body, default=300)
        metadata = str_map(body, "metadata")
        envs = str_map(body, "envVars")
        auto_pause = field(body, "autoPause", bool, False)
        auto_pause_memory = field(body, "autoPauseMemory", bool, True)
        auto_resume = field(body, "autoResume", dict, {})
        if field(body, "allow_internet_access", bool, False):
            raise ApiError(400, "allow_internet_access=true is not supported: rlk3 sandboxes have loopback only")
        for unsupported in ("volumeMounts", "mcp", "iam"):
            if body.get(unsupported):
                raise ApiError(400, f"field '{unsupported}' is not supported by the rlk3 sandbox server")
        rec = await m.create(
            template,
            timeout=timeout,
            metadata=metadata,
            envs=envs,
            on_timeout="pause" if auto_pause else "kill",
            timeout_memory=auto_pause_memory,
            auto_resume=bool(auto_resume.get("enabled")),
            backend=metadata.get(BACKEND_KEY),  # an rlk3 extension: metadata {"rlk3.backend": "gvisor"}
        )
        return JSONResponse(sandbox_json(rec), status_code=201)

    async def list_sandboxes(request: Request) -> Response:
        q = request.query_params
        states = set((q.get("state") or "running,paused").split(","))
        if not states <= {"running", "paused"}:
            raise ApiError(400, f"state must be a comma list of running, paused; got {q.get('state')!r}")
        want_meta = dict(parse_qsl(q.get("metadata") or ""))
        limit = _int_param(q.get("limit"), "limit", 100, 1, 1000)
        start = _int_param(q.get("nextToken"), "nextToken", 0, 0, 10**9)
        recs = sorted(
            (live.rec for live in m.live.values() if not live.rec.id.startswith("build-")),
            key=lambda r: (r.started_at, r.id),
        )
        recs = [r for r in recs if r.state in states and all(r.metadata.get(k) == v for k, v in want_meta.items())]
        if q.get("template"):
            recs = [r for r in recs if r.template_id == q.get("template")]
        page = recs[start : start + limit]
        headers = {"x-next-token": str(start + limit)} if start + limit < len(recs) else {}
        items = [
            {k: v for k, v in detail_json(r).items() if k not in ("lifecycle", "pauseMode", "allowInternetAccess")}
            for r in page
        ]
        return JSONResponse(items, headers=headers)

    async def list_v1(request: Request) -> Response:
        recs = [
            live.rec for live in m.live.values() if live.rec.state == "running" and not live.rec.id.startswith("build-")
        ]
        return JSONResponse([detail_json(r) for r in recs])

    async def info(request: Request) -> Response:
        return JSONResponse(detail_json(m.get(sid_of(request)).rec))

    async def kill(request: Request) -> Response:
        await m.kill(sid_of(request))
        return Response(status_code=204)

    async def pause(request: Request) -> Response:
        body = await json_body(request)
        memory = field(body, "memory", bool, True)
        # an rlk3 extension: X-Rlk3-Pause: freeze keeps memory resident (fastest), memory = CRIU, filesystem
        kind = request.headers.get("x-rlk3-pause")
        if kind is not None and kind not in ("freeze", "memory", "filesystem"):
            raise ApiError(400, f"X-Rlk3-Pause must be freeze, memory or filesystem; got {kind!r}")
        if not await m.pause(sid_of(request), memory=memory, kind=kind):
            raise ApiError(409, f"sandbox '{sid_of(request)}' is already paused")
        return Response(status_code=204)

    async def connect(request: Request) -> Response:
        body = await json_body(request)
        timeout = timeout_field(body)
        memory = field(body, "memory", bool, True)
        was_paused = m.get(sid_of(request)).rec.state == "paused"
        rec = await m.connect(sid_of(request), timeout=timeout, memory=memory)
        return JSONResponse(sandbox_json(rec), status_code=201 if was_paused else 200)

    async def resume_v1(request: Request) -> Response:
        body = await json_body(request)
        timeout = timeout_field(body)
        if m.get(sid_of(request)).rec.state != "paused":
            raise ApiError(409, f"sandbox '{sid_of(request)}' is already running")
        rec = await m.connect(sid_of(request), timeout=timeout)
        return JSONResponse(sandbox_json(rec), status_code=201)

    async def set_timeout(request: Request) -> Response:
        body = await json_body(request, required=True)
        timeout = timeout_field(body)
        if timeout is None:
            raise ApiError(400, "field 'timeout' is required (seconds)")
        await m.set_timeout(sid_of(request), timeout)
        return Response(status_code=204)

    async def refresh(request: Request) -> Response:
        body = await json_body(request)
        duration = timeout_field(body, "duration", 60)
        live = m.get(sid_of(request))
        import time as _t

        live.rec.end_at = max(live.rec.end_at, _t.time() + duration)
        return Response(status_code=204)

    async def fork(request: Request) -> Response:
        body = await json_body(request)
        count = field(body, "count", int, 1, what="an integer between 1 and 20")
        timeout = timeout_field(body)
        results = await m.fork(sid_of(request), count=count, timeout=timeout)
        out = []
        for r in results:
            if isinstance(r, SandboxRec):
                out.append({"sandbox": sandbox_json(r)})
            else:
                out.append({"error": {"code": 500, "message": str(r)}})
        return JSONResponse(out, status_code=201)

    async def snapshot(request: Request) -> Response:
        body = await json_body(request)
        name = field(body, "name", str)
        memory = field(body, "memory", bool, True)
        snap = await m.snapshot(sid_of(request), name=name, memory=memory)
        return JSONResponse({"snapshotID": snap.id, "names": snap.names}, status_code=201)

    async def list_snapshots(request: Request) -> Response:
        q = request.query_params
        limit = _int_param(q.get("limit"), "limit", 100, 1, 1000)
        start = _int_param(q.get("nextToken"), "nextToken", 0, 0, 10**9)
        snaps = sorted(m.snapshots.values(), key=lambda s: (s.created_at, s.id))
        if q.get("sandboxID"):
            snaps = [s for s in snaps if s.source == q.get("sandboxID")]
        if q.get("name"):
            snaps = [s for s in snaps if q.get("name") in s.names or s.id == q.get("name")]
        page = snaps[start : start + limit]
        headers = {"x-next-token": str(start + limit)} if start + limit < len(snaps) else {}
        return JSONResponse([{"snapshotID": s.id, "names": s.names} for s in page], headers=headers)

    async def delete_template(request: Request) -> Response:
        tid = request.path_params["tid"]
        if not await m.delete_snapshot(tid):
            raise ApiError(404, f"snapshot or template '{tid}' not found (built-in templates cannot be deleted)")
        return Response(status_code=204)

    async def metrics(request: Request) -> Response:
        data = m.metrics(sid_of(request))
        import time as _t

        now = _t.time()
        return JSONResponse([{**data, "timestamp": iso(now), "timestampUnix": int(now)}])

    async def network(request: Request) -> Response:
        raise ApiError(400, "network updates are not supported: rlk3 sandboxes have loopback only")

    async def server_health(request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "backend": m.default_backend,
                "backends": [n for n, be in m.backends.items() if not getattr(be, "available", None)],
                "sandboxes": len(m.live),
                "pooled": m.pooled(),  # warm sandboxes not yet handed out (not listed as sandboxes)
                "warming": sorted(m.warming),  # and those still booting
            }
        )

    routes = [
        Route("/v2/sandboxes", create, methods=["POST"]),
        Route("/sandboxes", create, methods=["POST"]),
        Route("/v2/sandboxes", list_sandboxes, methods=["GET"]),
        Route("/sandboxes", list_v1, methods=["GET"]),
        Route("/sandboxes/{sid}", info, methods=["GET"]),
        Route("/sandboxes/{sid}", kill, methods=["DELETE"]),
        Route("/sandboxes/{sid}/pause", pause, methods=["POST"]),
        Route("/sandboxes/{sid}/connect", connect, methods=["POST"]),
        Route("/v2/sandboxes/{sid}/connect", connect, methods=["POST"]),
        Route("/sandboxes/{sid}/resume", resume_v1, methods=["POST"]),
        Route("/sandboxes/{sid}/timeout", set_timeout, methods=["POST"]),
        Route("/sandboxes/{sid}/refreshes", refresh, methods=["POST"]),
        Route("/sandboxes/{sid}/fork", fork, methods=["POST"]),
        Route("/sandboxes/{sid}/snapshots", snapshot, methods=["POST"]),
        Route("/sandboxes/{sid}/metrics", metrics, methods=["GET"]),
        Route("/sandboxes/{sid}/network", network, methods=["PUT"]),
        Route("/snapshots", list_snapshots, methods=["GET"]),
        Route("/templates/{tid}", delete_template, methods=["DELETE"]),
        Route("/health", server_health, methods=["GET"]),
    ]

    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return error(exc.status, exc.message)

    async def on_http_error(request: Request, exc) -> Response:
        detail = getattr(exc, "detail", "") or ""
        status = getattr(exc, "status_code", 500)
        if status == 404:
            return error(404, f"no route {request.method} {request.url.path}")
        if status == 405:
            return error(405, f"method {request.method} is not allowed on {request.url.path}")
        return error(status, str(detail))

    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    from starlette.exceptions import HTTPException

    rest = Starlette(
        routes=routes,
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
    )

    # ---------------------------------------------------------------------------------- envd
    from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
    from e2b.envd.process.process_connect import ProcessASGIApplication

    process_app = ProcessASGIApplication(ProcessService(m), read_max_bytes=max_upload)
    fs_app = FilesystemASGIApplication(FilesystemService(m), read_max_bytes=16 << 20)

    async def envd_health(request: Request) -> Response:
        sid = request.headers["e2b-sandbox-id"]
        try:
            await m.link(sid)
        except ApiError as e:
            return error(502, e.message)
        return Response(status_code=204)

    async def files_get(request: Request) -> Response:
        sid = request.headers["e2b-sandbox-id"]
        path = request.query_params.get("path")
        if not path:
            raise ApiError(400, "query parameter 'path' is required")
        link = await m.link(sid)
        gen = link.read_file(path, request.query_params.get("username"))
        try:
            await gen.__anext__()  # the size; errors surface here, before the response starts
        except AgentError as e:
            await gen.aclose()
            raise ApiError({"not_found": 404, "permission_denied": 403}.get(e.code, 400), e.message) from None
        except AgentGone as e:
            raise ApiError(502, f"sandbox '{sid}' is not running: {e}") from None
        return StreamingResponse(gen, media_type="application/octet-stream")

    async def files_post(request: Request) -> Response:
        sid = request.headers["e2b-sandbox-id"]
        link = await m.link(sid)
        user = request.query_params.get("username")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_upload:
            raise ApiError(
                413,
                f"upload of {declared} bytes exceeds the limit of {max_upload} bytes (--max-upload-mb {max_upload_mb})",
            )
        ctype = request.headers.get("content-type", "")
        try:
            if ctype.startswith("multipart/form-data"):
                entries = await _multipart_upload(request, link, m, user, max_upload)
            else:
                path = request.query_params.get("path")
                if not path:
                    raise ApiError(400, "query parameter 'path' is required for an octet-stream upload")
                entries = [await _stream_upload(request, link, m, path, user, max_upload)]
        except TooLarge:
            raise ApiError(
                413, f"upload exceeds the limit of {max_upload} bytes (--max-upload-mb {max_upload_mb})"
            ) from None
        except AgentError as e:
            status = {"not_found": 404, "permission_denied": 403, "resource_exhausted": 507}.get(e.code, 400)
            raise ApiError(status, e.message) from None
        except AgentGone as e:
            raise ApiError(502, f"sandbox '{sid}' is not running: {e}") from None
        return JSONResponse([{"name": e["name"], "type": "file", "path": e["path"]} for e in entries])

    envd_rest = Starlette(
        routes=[
            Route("/health", envd_health, methods=["GET"]),
            Route("/files", files_get, methods=["GET"]),
            Route("/files", files_post, methods=["POST"]),
        ],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash},
    )

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await _lifespan(m, receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if api_key and "e2b-sandbox-id" not in headers and headers.get("x-api-key") != api_key and path != "/health":
            await error(401, "missing or wrong X-API-KEY")(scope, receive, send)
            return
        if path.startswith(ENVD_PREFIXES):
            target = process_app if path.startswith("/process.") else fs_app
            if "e2b-sandbox-id" not in headers:
                await error(400, "envd calls need the E2b-Sandbox-Id header")(scope, receive, send)
                return
            await target(scope, receive, send)
        elif "e2b-sandbox-id" in headers:
            await envd_rest(scope, receive, send)
        else:
            await rest(scope, receive, send)

    return app


def _int_param(raw: str | None, name: str, default: int, lo: int, hi: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter '{name}' must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ApiError(400, f"query parameter '{name}' must be between {lo} and {hi}, got {value}")
    return value


async def _stream_upload(request: Request, link, m: Manager, path: str, user: str | None, cap: int) -> dict:
    hdr, _ = await link.request("wopen", path=path, user=user)
    wid = hdr["rid"]
    total = 0
    decomp = zlib.decompressobj(16 + zlib.MAX_WBITS) if request.headers.get("content-encoding") == "gzip" else None
    try:
        async for chunk in request.stream():
            if decomp is not None:
                try:
                    chunk = decomp.decompress(chunk)
                except zlib.error as e:
                    raise ApiError(400, f"body is not valid gzip: {e}") from None
            total += len(chunk)
            if total > cap:
                raise TooLarge
            if chunk:
                await link.request("wdata", chunk, wid=wid)
    finally:
        hdr, _ = await link.request("wclose", wid=wid)
    return hdr["entry"]


async def _multipart_upload(request: Request, link, m: Manager, user: str | None, cap: int) -> list[dict]:
    """Streams each ``file`` part straight to the agent; never holds a whole upload in memory."""
    _, params = parse_options_header(request.headers["content-type"])
    boundary = params.get(b"boundary")
    if not boundary:
        raise ApiError(400, "multipart/form-data without a boundary")
    default_path = request.query_params.get("path")
    state: dict[str, Any] = {"headers": {}, "field": b"", "value": b""}
    parts: list[tuple[str, bytearray]] = []  # (path, pending bytes) in arrival order
    done: list[dict] = []
    total = 0

    def on_header_field(data, start, end):
        state["field"] += data[start:end]

    def on_header_value(data, start, end):
        state["value"] += data[start:end]

    def on_header_end():
        state["headers"][state["field"].decode().lower()] = state["value"].decode()
        state["field"], state["value"] = b"", b""

    def on_headers_finished():
        _, p = parse_options_header(state["headers"].get("content-disposition", ""))
        filename = p.get(b"filename")
        target = filename.decode() if filename else default_path
        if not target:
            raise ApiError(400, "multipart part has no filename and no ?path= was given")
        parts.append((target, bytearray()))
        state["headers"] = {}

    def on_part_data(data, start, end):
        parts[-1][1].extend(data[start:end])

    parser = MultipartParser(
        boundary,
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
        },
    )
    open_writes: dict[int, int] = {}  # index of part -> agent write id

    async def flush(final: bool) -> None:
        for i, (path, buf) in enumerate(parts):
            if i not in open_writes:
                hdr, _ = await link.request("wopen", path=path, user=user)
                open_writes[i] = hdr["rid"]
            if buf:
                await link.request("wdata", bytes(buf), wid=open_writes[i])
                buf.clear()
            last = i == len(parts) - 1
            if (not last or final) and open_writes.get(i) is not None:
                hdr, _ = await link.request("wclose", wid=open_writes[i])
                open_writes[i] = None
                done.append(hdr["entry"])

    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > cap:
                raise TooLarge
            try:
                parser.write(chunk)
            except ApiError:
                raise
            except Exception as e:
                raise ApiError(400, f"malformed multipart body: {e}") from None
            await flush(final=False)
        parser.finalize()
        await flush(final=True)
    finally:
        for wid in open_writes.values():
            if wid is not None:
                with contextlib.suppress(Exception):
                    await link.request("wclose", wid=wid)
    if not done:
        raise ApiError(400, "multipart body has no file part (field 'file')")
    return done


async def _lifespan(m: Manager, receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await m.start()
            except Exception as e:
                log.exception("sandbox server failed to start")
                await send({"type": "lifespan.startup.failed", "message": str(e)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            with contextlib.suppress(Exception):
                await m.stop()
            await send({"type": "lifespan.shutdown.complete"})
            return


__all__ = ["build_app", "gzip"]
