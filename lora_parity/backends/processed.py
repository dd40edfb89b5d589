"""vLLM's processed logprobs rebuilt on a trainer's logits (`logprobs_mode=processed_logprobs`; `models.sampling`):
the logits divided by the temperature, then vLLM's top-k and top-p masks (`vllm.v1.sample.ops.topk_topp_sampler.
apply_top_k_top_p_pytorch`, read in vLLM 0.32: top-k keeps every logit at least the k-th largest, ties too; top-p
sorts ascending and masks the tokens whose cumulative probability is at most 1 - p, the largest always kept), then
log_softmax, in fp32 as vLLM's sampler computes them. A token at the mask's edge may fall on either side on two
sides of different precision; it moves the drawn tokens' logprobs by the log of what it carried. A drawn token the
masks drop here is scored as kept (`keep`): over this side's set and it."""

from __future__ import annotations

import torch


def processed_logprobs(rows: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax over each row of fp32 logits `rows` at `temperature`, after top-k (0: off) and top-p (1: off).
    `keep` (a token id per row, the drawn ones) stays in its row's set whatever the masks say: a token the engine drew
    from its set and this side's masks drop is scored over this set and it (finite), not -inf."""
    logits = rows.float() / temperature
    tempered = logits
    if top_k or top_p < 1.0:
        ordered, index = logits.sort(dim=-1, descending=False)
        if top_k:
            kth = ordered[:, ordered.size(1) - min(top_k, ordered.size(1))].unsqueeze(1)
            ordered = ordered.masked_fill(ordered < kth, -float("inf"))
        if top_p < 1.0:
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1 - top_p
            drop[:, -1] = False  # at least one
            ordered = ordered.masked_fill(drop, -float("inf"))
        logits = torch.empty_like(logits).scatter_(-1, index, ordered)
        if keep is not None:
            column = keep.view(-1, 1)
            logits.scatter_(-1, column, tempered.gather(-1, column))
    return torch.log_softmax(logits, dim=-1)
