"""The old path of `lora_parity.models.synthetic`, kept for scripts outside the package
(`from lora_parity import synthetic; synthetic.materialize(cfg)`); nothing in lora_parity imports it."""

from lora_parity.models.synthetic import materialize

__all__ = ["materialize"]
