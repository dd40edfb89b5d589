"""lora-parity: prove that an RL trainer and its inference sampler agree on LoRA logprobs."""

__version__ = "0.1.0"
