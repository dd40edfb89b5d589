"""A torch tensor as (safetensors dtype, shape, little-endian bytes): what a `TensorReadingTrainer`
gives the exact sync check (`models.fresh_adapter`)."""

from __future__ import annotations

import torch

from lora_parity.models.fresh_adapter import RawTensor

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def to_raw(t: torch.Tensor) -> RawTensor:
    """The tensor's values as they are (no cast), copied to the host."""
    host = t.detach().to("cpu").contiguous()
    return DTYPES[host.dtype], list(host.shape), host.view(torch.uint8).numpy().tobytes()
