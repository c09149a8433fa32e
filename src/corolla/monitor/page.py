"""The monitor's web page: one HTML file (page.html, no external resources) with its settings and the current
state embedded, so the first paint needs no second request; its script then polls the state URL."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

from corolla.monitor.schema import SwarmState

CHAT_MAX_TOKENS = 256  # tokens the chat box asks for per reply
# Announced strings (a model_type, an adapter's name) are remote input embedded in a <script> element: "</script>"
# would end it and "<!--<script>" would make the HTML parser swallow the page's own script after it. These
# characters only ever occur inside JSON strings, where their \u escapes mean the same to JSON.parse.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


@lru_cache(maxsize=1)
def _template() -> str:
    return resources.files("corolla.monitor").joinpath("page.html").read_text(encoding="utf-8")


def render_page(state: SwarmState | None, *, state_url: str, refresh_period: float, chat_url: str | None = None) -> str:
    """The page's HTML. `chat_url`: an OpenAI-compatible `/v1/chat/completions` endpoint the chat box streams from
    (its `/v1/models` sibling names the model); None hides the chat box."""
    models_url = chat_url.rsplit("/chat/completions", 1)[0] + "/models" if chat_url else None
    config = {
        "state_url": state_url,
        "refresh_ms": max(250, int(refresh_period * 1000)),
        "chat_url": chat_url,
        "models_url": models_url,
        "chat_max_tokens": CHAT_MAX_TOKENS,
        "initial_state": None if state is None else state.model_dump(mode="json"),
    }
    return _template().replace("__PAGE_CONFIG__", script_safe_json(config))


def script_safe_json(value: object) -> str:
    """JSON of `value` safe to embed in an HTML <script> element: no <, >, &, U+2028 or U+2029 left in it."""
    return json.dumps(value).translate(_SCRIPT_SAFE)
