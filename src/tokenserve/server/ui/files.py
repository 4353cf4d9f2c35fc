"""`with_ui`: the OpenAI app with the UI's page in front of it and its stats route inside it."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI

from .stats import stats_router

INDEX_PATH = "/"
STATIC_PREFIX = "/ui/static/"

_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                  ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-content-type-options", b"nosniff"),
    # the page only talks to its own origin and runs only its own files (no inline script)
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; "
                                 b"frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
]


class StaticUI:
    """ASGI app: serves the UI's files (GET/HEAD `/` and `/ui/static/<file>`) without an API
    key, and passes every other request to `app` (which checks keys as it always does).

    The files are read once, when built; a path is served only if it names one of them
    exactly, so no request reaches the file system.

    Args:
        app: the OpenAI app.
    """

    def __init__(self, app) -> None:
        self.app = app
        folder = resources.files(__package__) / "static"
        self.files: dict[str, tuple[bytes, bytes]] = {}
        for entry in folder.iterdir():
            suffix = "." + entry.name.rsplit(".", 1)[-1]
            if entry.is_file() and suffix in _CONTENT_TYPES:
                self.files[STATIC_PREFIX + entry.name] = (entry.read_bytes(),
                                                         _CONTENT_TYPES[suffix].encode())
        self.files[INDEX_PATH] = self.files[STATIC_PREFIX + "index.html"]

    async def __call__(self, scope, receive, send) -> None:
        found = self.files.get(scope["path"]) if scope["type"] == "http" else None
        if found is None or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        body, content_type = found
        headers = [(b"content-type", content_type),
                   (b"content-length", str(len(body)).encode()), *_HEADERS]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body",
                    "body": body if scope["method"] == "GET" else b""})


def with_ui(app: FastAPI, manager, registry) -> StaticUI:
    """Adds the UI to the OpenAI app: `/ui/api/stats` inside it (behind its API-key check),
    and the page in front of it.

    Args:
        app: from `build_openai_app`.
        manager: the server's ModelManager (the models table: versions, states, labels).
        registry: the Prometheus registry the engines record into (the charts).

    Returns:
        The ASGI app to serve in place of `app`.

    Example:
        app = build_openai_app(ManagedModels(manager), OpenAIServerConfig(...))
        uvicorn.run(with_ui(app, manager, registry), port=8000)
    """
    app.include_router(stats_router(manager, registry))
    return StaticUI(app)
