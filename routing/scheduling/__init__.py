"""Scheduling: the filter -> scorers -> picker framework (scoring), the scorers (scorers, approx
for the router-side prefix guess, slo for the capacity model) and the named strategies
(strategies: the registry the Router, the configuration and the README read).

It may import state/ and learning/ for what its scorers read; nothing here imports discovery/.
"""
