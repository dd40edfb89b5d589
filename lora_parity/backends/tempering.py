"""A trainer that scores drawn tokens at a temperature (`models.sampling.tempered`): where the engine reports processed
logprobs at temperature T, the trainer's scores of the same tokens are log_softmax(logits / T) at the drawn positions
and raw at the prompt's, as the engine's rows are (its prompt logprobs stay raw)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lora_parity.backends.base import Scores, Sequences


@runtime_checkable
class TemperingTrainer(Protocol):
    """A trainer whose scores of sequences can be taken at a temperature past each prompt."""

    def score_tempered(self, sequences: Sequences, temperature: float, prompt_lengths: list[int]) -> Scores:
        """`score`'s rows (the alignment rule in backends/base.py), entry t at temperature `temperature` where token
        t+1 was drawn (t + 1 >= the sequence's prompt length), raw before."""
        ...
