"""The old path of `lora_parity.evidence.receipt`, kept for scripts outside the package
(`from lora_parity.receipt import compute_digest`); nothing in lora_parity imports it."""

from lora_parity.evidence.receipt import compute_digest

__all__ = ["compute_digest"]
