"""What a run reports: progress, Prometheus metrics, trackers, samples, step records."""
