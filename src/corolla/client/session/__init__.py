"""The token session: what the servers hold (positions, their token ids and mask, rollbacks, beam reorders,
prompt-tuning prompts; `session_state`, pure) and `InferenceSession`, which checks each step and runs it through
its chain, and applies the spot checks' rewinds.

May import: swarm, trust, chain.
"""
