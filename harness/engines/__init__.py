"""Stand-ins for a job's processes: test rollout engines, a vLLM server, a trainer's progress."""
