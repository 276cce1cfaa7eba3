"""Multi-turn episodes: environments, agents through an OpenAI-compatible endpoint, turn tokens."""
