"""The HF sampler's generation: one prompt at a time, incremental decoding with a KV cache."""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def generate_one(model: Any, prompt: list[int], max_tokens: int, seed: int, device: torch.device) -> tuple[
        list[int], list[float]]:
    """Sample `max_tokens` tokens after `prompt` at temperature 1 (a CPU generator seeded with `seed`,
    KV cache, no stop token); the prompt + completion and its logprobs as `GeneratingSampler` states."""
    generator = torch.Generator().manual_seed(seed)
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    logits = out.logits[0].float()
    target = torch.tensor(prompt[1:], device=device)
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, target[:, None])[:, 0].cpu().tolist()
    seq, last, past = list(prompt), logits[-1], out.past_key_values
    for _ in range(max_tokens):
        dist = torch.log_softmax(last, dim=-1)
        token = int(torch.multinomial(dist.exp().cpu(), 1, generator=generator).item())
        seq.append(token)
        logprobs.append(float(dist[token].item()))
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        last, past = out.logits[0, -1].float(), out.past_key_values
    return seq, logprobs
