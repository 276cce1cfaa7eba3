"""The built-in reward functions: text, math, code, assert tests, reward models, weighted sums."""
