"""The server: loads a contiguous range of blocks, announces it in the DHT and serves RPCs on P2P streams.

Its parts, lowest first (each package's docstring says what it may import; tests/unit/test_layout.py enforces it):

    cache     KV-cache memory: the token budget, the fair queue in front of it (pure decisions), sessions' caches
    compute   the math: the block stack, the pure step planner, the scheduler and the batching compute worker
    loading   only this server's blocks from a checkpoint, quantized, tensor-parallel, with LoRA adapters
    presence  being found: the announcer, throughput and network measurement, next hops, block choice (pure)
    rpc       the request path: stream handlers, validation, sessions, per-peer limits, push, fault injection

`config.py` (ServerConfig), `errors.py` (RequestError) and `metrics.py` (Prometheus, fed by compute, cache and rpc)
are used by every part; `server.py`, the process, sits on top of them all.
"""
