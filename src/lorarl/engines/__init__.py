"""What lorarl knows about each rollout engine (flags, HTTP API, env), as pure values; no I/O."""
