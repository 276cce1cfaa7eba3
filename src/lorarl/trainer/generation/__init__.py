"""Rank 0's rollouts over HTTP: engine wire formats, the client, sampling, liveness, scoring,
eval."""
