"""The RL math, pure and the same on every rank: advantages, losses, KL, overlong, dynamic
sampling."""
