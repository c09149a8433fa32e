"""The request path: stream acceptance and registration (`handler`), what the handlers share (`parts`), inference
sessions and the one path every step takes (`inference`), steps pushed by the previous server (`push_receiver`),
stateless calls (`stateless`: forward, backward, info, probe), every check on what a client sends (`validation`),
open sessions with their reservations and caches (`sessions`), per-peer limits (`peer_limits`), push links and
outgoing pushes (`push`) and fault injection for tests (`faults`).

May import: cache, compute, loading, presence.
"""
