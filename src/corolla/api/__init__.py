"""The OpenAI-compatible HTTP API in front of a swarm (`corolla api`).

One process serves many streams: a batched engine on the client's event loop runs one LM-head pass and one
sampling pass over every active stream per step, while each stream keeps its own inference session on the swarm
(the servers batch the decode steps). Finished sessions stay open for a while so a follow-up turn continues them.
Nothing is imported here: importing corolla must stay cheap.
"""
