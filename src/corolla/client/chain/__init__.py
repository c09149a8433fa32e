"""One inference session's route through the servers: a stream per span (`span_session`), the route opened and
replayed into (`route_opening`), push links (`push_route`), every answer checked (`push_audit`), long steps in
chunks (`pipelined_prefill`), steps in flight (`pass_pipe`), standby replicas fed alongside the spans and promoted
when one fails (`standby`), and failover: who is at fault (`failover_plan`, pure) and what is done about it
(`chain`).

May import: swarm.
"""
