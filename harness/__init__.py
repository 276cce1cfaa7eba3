"""What tests and benchmarks run lorarl in: a real cluster, stand-ins, faults and workloads."""
