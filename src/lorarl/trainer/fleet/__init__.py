"""The rollout replicas: membership, weight publishing, the stale-policy guard, engine memory."""
