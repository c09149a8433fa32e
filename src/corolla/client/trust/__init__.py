"""Trusting servers' outputs: spot checks that recompute a span on another server (`spot_checks`; the pure measure,
tolerances and decisions in `verification`), the client computing a disputed span itself (`referee`), a standby
replica's answers judged against its primary's (`standby_judge`), and the per-peer record of checks passed and
failed (`reputation`). The chain reports every answer it accepts through its StepObserver protocol, and standby
answers through its StandbyJudge protocol, so the chain never imports this package.

May import: swarm.
"""
