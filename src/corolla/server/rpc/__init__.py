"""The request path: stream handlers (`handler`: read, check, plan, run, write), every check on what a client sends
(`validation`), open sessions with their reservations and caches (`sessions`), per-peer limits (`peer_limits`),
server-to-server push (`push`) and fault injection for tests (`faults`).

May import: cache, compute, loading, presence.
"""
