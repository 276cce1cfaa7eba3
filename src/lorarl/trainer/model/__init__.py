"""The policy on this rank: base model + LoRA (PEFT), FSDP2, critic, logprobs, precision, memory."""
