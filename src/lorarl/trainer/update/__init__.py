"""One update on this rank's samples: batches, micro-batches, the actor step, PPO, the schedule."""
