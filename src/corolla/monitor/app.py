"""The monitor's HTTP routes, addable to any FastAPI app (the standalone `corolla monitor`, or `corolla api`).

    GET /               the page (HTML; chat box only when `chat_url` is given)
    GET /api/v1/state   SwarmState as JSON (schema: corolla.monitor.schema; `?history=false` leaves out history)
    GET /metrics        swarm-level Prometheus text (corolla.monitor.prometheus)
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from corolla.monitor.page import render_page
from corolla.monitor.prometheus import CONTENT_TYPE, render, swarm_registry
from corolla.monitor.schema import SwarmState
from corolla.monitor.source import SwarmMonitor

STATE_PATH = "/api/v1/state"
FIRST_STATE_WAIT = 30.0  # seconds the page and the JSON wait for the monitor's first refresh


def add_monitor_routes(app: FastAPI, monitor: SwarmMonitor, chat_url: str | None = None, metrics: bool = True) -> None:
    """Serve `monitor`'s page, JSON and (unless `metrics` is False, e.g. where the app has its own /metrics)
    Prometheus text from `app`. The caller runs the monitor (`refresh()` then `run()`) in its DHT node's event loop,
    which may be another thread's.
    `chat_url`: the app's OpenAI-compatible chat completions path, shown as the page's chat box."""
    registry = swarm_registry(monitor)

    async def current(with_history: bool) -> SwarmState | None:
        """The monitor's state; before its first refresh, polled for up to FIRST_STATE_WAIT seconds (the monitor may
        run in another loop or thread, so nothing here awaits its primitives)."""
        deadline = time.monotonic() + FIRST_STATE_WAIT
        while (state := monitor.current(with_history)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return state

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        state = await current(with_history=True)
        html = render_page(state, state_url=STATE_PATH, refresh_period=monitor.config.refresh_period, chat_url=chat_url)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get(STATE_PATH, response_model=SwarmState, summary="The swarm as the monitor last saw it")
    async def state(history: bool = True) -> Response:
        snapshot = await current(with_history=history)
        if snapshot is None:
            return Response(
                '{"detail": "the monitor has not read the swarm yet"}', status_code=503, media_type="application/json"
            )
        return Response(
            snapshot.model_dump_json(), media_type="application/json", headers={"Cache-Control": "no-store"}
        )

    if metrics:

        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics() -> Response:
            return Response(render(registry), media_type=CONTENT_TYPE)


def create_monitor_app(monitor: SwarmMonitor, chat_url: str | None = None) -> FastAPI:
    """A FastAPI app serving only the monitor's routes."""
    app = FastAPI(title="corolla monitor", docs_url="/api/docs", redoc_url=None, openapi_url="/api/openapi.json")
    add_monitor_routes(app, monitor, chat_url=chat_url)
    return app
