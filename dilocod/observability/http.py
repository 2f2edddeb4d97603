"""The node's HTTP face, the same on the bootstrap and on every peer.

- `/`: the run dashboard (`dilocod/web/`, plain HTML/JS/CSS; it polls the JSON API below);
- `/metrics`: Prometheus metrics of this node;
- `/api/status`: this node (a peer's includes its recent rounds);
- `/api/run`: `peers`, every live peer's latest status record, from this node's view of the DHT,
  `dataset`, the run's progress through its dataset (the chunk schedule), as this node knows it, and
  `sample`, the newest completion of the run's prompt from θ_global (`runview.newest_sample`), and
  `scoring`, each scored peer's rating and latest verdicts (`scoreview.score_view`; null when the run
  does not score contributions);
- `/api/run/manifest`: the run manifest this node runs with (`dilocod/manifest/`), with its hash;
- `/api/history`: what this node has seen of the run over time (`dilocod.observability.history`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from dilocod.observability.history import RunHistory
from dilocod.observability.metrics import Metrics

StatusFn = Callable[[], dict[str, Any]]
RunFn = Callable[[], Awaitable[list[dict[str, Any]]]]
ScoringFn = Callable[[], Awaitable[dict[str, Any] | None]]

STATIC = {"app.js": "application/javascript", "style.css": "text/css"}


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
    return web.Response(
        text=json.dumps(_json_safe(payload)),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


class HttpServer:
    def __init__(
        self,
        metrics: Metrics,
        status: StatusFn,
        run: RunFn,
        history: RunHistory | None = None,
        manifest: Callable[[], dict[str, Any] | None] | None = None,
        dataset: Callable[[], dict[str, Any] | None] | None = None,
        sample: Callable[[list[dict[str, Any]]], dict[str, Any] | None] | None = None,
        scoring: ScoringFn | None = None,
    ) -> None:
        self._metrics, self._status, self._run, self._manifest = metrics, status, run, manifest
        self._dataset, self._sample, self._scoring = dataset, sample, scoring
        self._history = history if history is not None else RunHistory()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/api/status", self._status_handler)
        app.router.add_get("/api/run", self._run_handler)
        app.router.add_get("/api/run/manifest", self._manifest_handler)
        app.router.add_get("/api/history", self._history_handler)
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
        page = resources.files("dilocod.observability.web").joinpath("index.html").read_text()
        return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-cache"})

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:  # a fixed list: no path ever reaches the file system from a request
            raise web.HTTPNotFound()
        text = resources.files("dilocod.observability.web").joinpath(name).read_text()
        return web.Response(text=text, content_type=STATIC[name], headers={"Cache-Control": "no-cache"})

    async def _metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), content_type="text/plain", charset="utf-8")

    async def _status_handler(self, _request: web.Request) -> web.Response:
        return json_response(self._status())

    async def _run_handler(self, _request: web.Request) -> web.Response:
        dataset = self._dataset() if self._dataset is not None else None
        peers = await self._run()
        sample = self._sample(peers) if self._sample is not None else None
        scoring = await self._scoring() if self._scoring is not None else None
        return json_response({"peers": peers, "dataset": dataset, "sample": sample, "scoring": scoring})

    async def _manifest_handler(self, _request: web.Request) -> web.Response:
        manifest = self._manifest() if self._manifest is not None else None
        if manifest is None:
            raise web.HTTPNotFound(text="this node has no run manifest")
        return json_response(manifest)

    async def _history_handler(self, _request: web.Request) -> web.Response:
        return json_response(self._history.snapshot())
