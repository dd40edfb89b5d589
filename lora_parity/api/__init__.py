"""api: the public Python API: `check` runs the sequence on a caller's own trainer, engine and sync (protocols),
wrapped as backends (`caller`) and handed to the runner; what it returns is `Result`, with the CLI's receipt.
May import util/, evidence/, verdict/, models/, backends/ and run/; only stacks/ and cli/ may import it.

Use it from a pytest test or a training-loop callback (docs/api.md):

    from lora_parity.api import check

    result = check(trainer, engine, sync, sequences, alpha=16.0, out="receipts/sync.json")
    assert result.passed, result.summary()
"""

from lora_parity.api.parity_check import Result, check
from lora_parity.api.protocols import (
    BaseScoringEngine,
    CachedScoringEngine,
    Described,
    Engine,
    Sync,
    TensorLoadingEngine,
    Trainer,
)

__all__ = [
    "BaseScoringEngine",
    "CachedScoringEngine",
    "Described",
    "Engine",
    "Result",
    "Sync",
    "TensorLoadingEngine",
    "Trainer",
    "check",
]
