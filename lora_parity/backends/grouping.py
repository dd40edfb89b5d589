"""Consecutive groups of sequences, one forward or request each (re-exported by `backends.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lora_parity.models.config import ModelConfig

Sequences = list[list[int]]


def groups(sequences: Sequences, batch_size: int = 1, pack_tokens: int = 0) -> list[slice]:
    """Consecutive groups of `sequences`, one forward or generate call each: `batch_size` sequences, or
    with `pack_tokens` as many as fit in that many tokens once right-padded to the group's longest (at
    least one), so a scoring pass takes calls in proportion to its tokens, not to its sequences."""
    out: list[slice] = []
    start = 0
    while start < len(sequences):
        end, width = start + 1, len(sequences[start])
        while end < len(sequences):
            grown = max(width, len(sequences[end]))
            if (grown * (end + 1 - start) > pack_tokens) if pack_tokens else end - start >= batch_size:
                break
            end, width = end + 1, grown
        out.append(slice(start, end))
        start = end
    return out


def forward_description(cfg: ModelConfig, pack: int = 0) -> str:
    """How an HF backend groups sequences (`pack`: the trainer's tokens per forward), for the receipt."""
    n = cfg.scoring.batch_size
    grouping = "one sequence per forward" if n == 1 else f"{n} sequences per forward, right-padded"
    if pack:
        grouping = f"sequences packed up to {pack} padded tokens per forward, right-padded"
    return f"{grouping}, log-softmax in fp32"
