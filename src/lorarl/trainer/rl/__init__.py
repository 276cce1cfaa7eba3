"""Pure RL math, the same on every rank: advantages, losses, KL, overlong, DAPO, the TrainSample."""
