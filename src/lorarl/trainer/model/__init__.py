"""This rank's policy: base + LoRA, FSDP2, critic, logprobs, micro-batches, precision, memory."""
