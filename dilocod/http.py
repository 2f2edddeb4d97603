"""The node's HTTP face: `/metrics` (Prometheus), `/api/status` (this node), `/api/run` (the whole run)."""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from dilocod.metrics import Metrics

StatusFn = Callable[[], dict[str, Any]]
RunFn = Callable[[], Awaitable[list[dict[str, Any]]]]


def _json_safe(value: Any) -> Any:
    """NaN/Inf are not JSON: they become null so that every client can parse the answer."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def json_response(payload: Any) -> web.Response:
    return web.Response(text=json.dumps(_json_safe(payload)), content_type="application/json")


class HttpServer:
    def __init__(self, metrics: Metrics, status: StatusFn, run: RunFn) -> None:
        self._metrics, self._status, self._run = metrics, status, run
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/api/status", self._status_handler)
        app.router.add_get("/api/run", self._run_handler)
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _index(self, _request: web.Request) -> web.Response:
        page = resources.files("dilocod.web").joinpath("index.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def _metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), content_type="text/plain", charset="utf-8")

    async def _status_handler(self, _request: web.Request) -> web.Response:
        return json_response(self._status())

    async def _run_handler(self, _request: web.Request) -> web.Response:
        return json_response(await self._run())
