"""The reward service (Ray Serve) and its client: auth, retries (cancellation: `sandbox.cancel`)."""
