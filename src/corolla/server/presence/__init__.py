"""Being found and chosen: the announcer keeping the DHT record fresh, which blocks to serve and when to move
(`block_selection`, pure), throughput and network measurement, and the round trips to likely next hops announced
for push routing (`next_hops`).

May import: nothing of the server's other parts (only server.config, server.errors and server.metrics).
"""
