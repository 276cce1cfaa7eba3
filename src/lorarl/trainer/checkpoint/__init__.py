"""Checkpoints and exports: atomic, self-verifying, written by one rank."""
