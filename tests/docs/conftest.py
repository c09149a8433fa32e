"""The `docs` marker: tests that run the documentation's snippets against a local swarm (several minutes);
`-m "not docs"` leaves them out."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "docs: runs the documentation's snippets against a local swarm (several minutes)")
