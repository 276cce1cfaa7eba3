"""Untrusted code (model completions) behind an OS boundary with hard resource caps, and the
scopes that cancel it."""
