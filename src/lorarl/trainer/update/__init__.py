"""One update on this rank's samples: batches, the shared optimizer steps, the actor step, PPO, the
schedule, and the `Updater` the loop calls."""
