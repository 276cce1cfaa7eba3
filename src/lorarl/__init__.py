"""lorarl: Kubernetes-native RL fine-tuning of LLMs with LoRA adapters."""

__version__ = "0.1.0"
