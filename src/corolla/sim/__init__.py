"""`corolla simulate`: a whole swarm simulated on one machine, driven by the product's own decision code.

No sockets and no model: simulated servers and clients call the functions real ones call (block choice and the
move decision in server.presence, routes in client.swarm.routing, bans and backoff in client.swarm.bans, failover
in client.chain.failover_plan, cache admission in server.cache.queue) on a simulated clock, with a WAN, speed
classes, a measured step cost and churn. Its parts:

    scenario    what is simulated (Scenario: CLI flags and scenario files, validated)
    step_cost   the real engine's per-block step time vs batch size, measured once
    wan         regions, round trips, access latencies
    events      the clock: a heap of timed events
    dht         server records with expiry, the placement view, DHT bytes
    fluid       decode as a fluid: per-session token rates from the servers' batches, solved every tick
    servers     server lives: join, settle, load, check, move (drain), leave
    sessions    session lives: route, open (cache), prefill, decode, failover, finish
    policy      corolla's rules (its own code, its own defaults); petals: Petals 2.2's rules
    metrics     what is measured, and the JSON object
    simulator   the World that ties them, and `simulate(scenario)`
"""

from corolla.sim.scenario import Scenario
from corolla.sim.simulator import simulate

__all__ = ["Scenario", "simulate"]
