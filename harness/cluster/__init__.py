"""A real Kubernetes control plane on this machine, the clients and jobs that use it."""
