"""The public model classes: `causal_lm` (DistributedModelForCausalLM and its Auto loader: the client's head over
the swarm's blocks), `classification` (a sequence classifier on top), `sequential` (RemoteSequential: the swarm's
blocks as a torch module) and `ptune` (prompt tuning).

May import: swarm, trust, chain, session, decoding.
"""
