"""Faults injected into running jobs, and the figures that judge recovery from them."""
