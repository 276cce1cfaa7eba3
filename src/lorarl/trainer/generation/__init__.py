"""Rank 0's rollouts over HTTP: wire formats, the client, sampling, liveness, rewards, eval."""
