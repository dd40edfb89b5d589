"""The LoRA layers that wrap megatron-core's column- and row-parallel linears (Megatron-Bridge's
names and math): out = base(x) + alpha/r · B(A(x)), A = `adapter.linear_in`, B = `adapter.linear_out`.

Shape suffixes: _R rank r, _I input features, _O output features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Adapter(torch.nn.Module):
    """A (`linear_in`, R x I) and B (`linear_out`, O x R) of one LoRA, as this rank holds them."""

    def __init__(self, in_features: int, out_features: int, rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.linear_in = torch.nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.linear_out = torch.nn.Linear(rank, out_features, bias=False, dtype=dtype, device=device)


class LoRALinear(torch.nn.Module):
    """base(x) + alpha/r · B(A(x)) around a megatron-core Column/RowParallelLinear (`to_wrap`).

    Row-parallel: x is sharded on its features like A's columns, so A(x) is a partial sum, reduced
    over the tensor-parallel group before B (held whole) is applied. Column-parallel: x is whole,
    A is whole, B holds this rank's output rows, like the base layer's output; A(x)'s gradient is
    summed over the group in backward (`copy`)."""

    def __init__(self, base: torch.nn.Module, column_parallel: bool, rank: int, alpha: float,
                 tp_group: Any, reduce: Callable[..., torch.Tensor], copy: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.to_wrap = base
        weight: torch.Tensor = base.weight  # type: ignore[assignment]
        out_local, in_local = weight.shape
        self.adapter = Adapter(in_local, out_local, rank, weight.dtype, weight.device)
        self.column_parallel = column_parallel
        # alpha/r of the adapter, also after `set_rank` gives a fused layer several parts' blocks.
        self.scaling = alpha / rank
        self._tp_group = tp_group
        self._reduce = reduce
        self._copy = copy

    def set_rank(self, rank: int) -> None:
        """A new A (R x I) and B (O x R) of rank `rank` (contents uninitialised), the scaling unchanged:
        a fused layer holding an imported adapter's parts as blocks (`blocks`) has R = parts x r."""
        a, b = self.adapter.linear_in.weight, self.adapter.linear_out.weight
        self.adapter = Adapter(a.shape[1], b.shape[0], rank, a.dtype, a.device)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, bias = self.to_wrap(x, *args, **kwargs)
        h = self.adapter.linear_in(x)
        if not self.column_parallel:
            h = self._reduce(h, group=self._tp_group)
        else:
            # Forward: h as it is. Backward (`--update step`): h's gradient summed over the ranks, since
            # each rank's B rows give only its share; A (held whole) and x then get the whole gradient.
            h = self._copy(h, group=self._tp_group)
        # As PEFT: result + lora_B(lora_A(x)) * scaling.
        return out + self.adapter.linear_out(h) * self.scaling, bias
