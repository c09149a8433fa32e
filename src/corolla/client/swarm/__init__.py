"""The swarm as a client sees it: which servers hold which blocks (the DHT view, refreshed and pinged), who is
banned and for how long (`bans`, pure), the route a session or a forward pass takes (pure functions in `routing`,
over the priced view of `route_index`), the typed stream to one server (`connection`), and stateless
forward/backward calls through servers (`remote_blocks`).

May import: nothing of the client's other parts (only client.config and client.event_loop).
"""
