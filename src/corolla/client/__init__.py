"""The client: holds the embeddings, the final norm and the LM head, and runs hidden states through the swarm.

Its parts, lowest first (each package's docstring says what it may import; tests/unit/test_layout.py enforces it):

    swarm     who serves which blocks, how to reach them: the DHT view, bans, routes, streams, stateless calls
    trust     spot checks of servers' outputs, the client's own referee, the reputation record
    chain     one session's route: span streams, push and relay, steps in flight, failover
    session   the token session over its chain: positions, tokens, rollback, reorder, rewinds
    decoding  generate: the one stepper under greedy, sampling, beam search and (pipelined) speculation
    model     the public model classes (causal LM, sequence classification), prompt tuning, RemoteSequential

`config.py` (ClientConfig) and `event_loop.py` (the one asyncio loop of the process) are used by every part.
"""
