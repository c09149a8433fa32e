"""Generation with Hugging Face's arguments: `generate` reads a call against the session, and every decoding loop
(greedy and sampling in `generation`, `beam_search`, `speculative`, `speculative_pipeline`) steps the session
through one `stepper`; drafters (`prompt_lookup`, `assistant_drafter`); HF's settings, processors and criteria
(`settings`); spot-check rewinds of a generation (`rewinder`).

May import: swarm, trust, chain, session.
"""
