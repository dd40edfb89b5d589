"""The old path of `lora_parity.models.config`, kept for scripts outside the package
(`from lora_parity import config; config.load(name)`); nothing in lora_parity imports it."""

from lora_parity.models.config import load

__all__ = ["load"]
