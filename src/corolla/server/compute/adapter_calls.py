"""Running compute functions with one of the server's LoRA adapters active (the adapters are loaded by
server.loading.adapters; a request names the one its steps use)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from corolla.models.lora import using_adapter


class AdapterCalls:
    """The adapters a server holds, and compute functions bound to one of them.

    ``bind(fn, name)`` returns one callable per (fn, name), kept for this object's life, so that the compute
    worker, which batches only tasks with equal functions, batches steps of the same adapter together.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._bound: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}

    def problem(self, name: str | None) -> str | None:
        """Why a request for adapter ``name`` cannot be served here, or None (no adapter, or one we hold)."""
        if name is None or name in self.names:
            return None
        held = ", ".join(repr(n) for n in self.names) or "none"
        return f"adapter {name!r} is not loaded on this server (its adapters: {held})"

    def bind(self, fn: Callable[..., Any], name: str | None) -> Callable[..., Any]:
        """``fn`` itself for no adapter, else a callable running ``fn`` with adapter ``name`` active."""
        if name is None:
            return fn
        key = (fn, name)
        bound = self._bound.get(key)
        if bound is None:

            @functools.wraps(fn)  # keeps fn's name: server metrics tell compute paths apart by it
            def bound(*args: Any) -> Any:
                with using_adapter(name):
                    return fn(*args)

            self._bound[key] = bound
        return bound
