"""The reward service (Ray Serve) and its client: auth, cancellation, retries."""
