"""Prompt datasets: files in the formats users have, prompts, epochs."""
