"""The README and docs: their manifests and code blocks run."""
