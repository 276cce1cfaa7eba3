"""The rollout replicas (rank 0): membership, publishing each version, the stale-policy guard,
engine memory."""
