"""Tools for testing corolla swarms: hostile peers that perform the attacks the trust model must withstand (used by
the test suite and by bench/bench_attacks.py). Nothing in corolla's serving or client paths imports this package."""
