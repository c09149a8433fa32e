"""KV-cache memory: the token budget and what each peer holds of it (`budget`), the queue's pure decisions (first
fit in arrival order with an aging bound and per-peer fairness, `queue`), the allocator that keeps waiters in the
event loop (`allocator`), and a session's keys and values per block (`kv`).

May import: nothing of the server's other parts (only server.config, server.errors and server.metrics).
"""
