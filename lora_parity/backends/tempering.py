"""A trainer that scores drawn tokens as processed (`models.sampling.tempered`): where the engine reports processed
logprobs at temperature T, top-k and top-p, the trainer's scores of the same tokens are log_softmax(logits / T) over
the kept set at the drawn positions (`backends.processed`) and raw at the prompt's, as the engine's rows are (its
prompt logprobs stay raw)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lora_parity.backends.base import Scores, Sequences


@runtime_checkable
class TemperingTrainer(Protocol):
    """A trainer whose scores of sequences can be taken at a temperature past each prompt."""

    def score_tempered(self, sequences: Sequences, temperature: float, prompt_lengths: list[int], top_k: int = 0,
                       top_p: float = 1.0) -> Scores:
        """`score`'s rows (the alignment rule in backends/base.py), entry t as the engine's processed logprob where
        token t+1 was drawn (t + 1 >= the sequence's prompt length): at `temperature`, renormalized over the top-k
        (0: off) and top-p (1: off) set; raw before."""
        ...
