"""`perturb.UnitNoise` (issue 47): a search's perturbs reuse each tensor's draw for the seed, and give exactly the
B of a fresh draw at every std and seed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lora_parity.backends.hf import HFTrainer  # noqa: E402
from lora_parity.models import config, synthetic  # noqa: E402
from lora_parity.models.perturb import UnitNoise, noise_seed  # noqa: E402


def _b(trainer: HFTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer._lora_b()}


def test_a_kept_draw_scales_to_the_fresh_draws_values() -> None:
    noise = UnitNoise()
    first = noise.scaled("layers.0.q_proj.lora_B", (4, 3), 7, 0.25)
    again = noise.scaled("layers.0.q_proj.lora_B", (4, 3), 7, 0.5)
    fresh = torch.randn([4, 3], generator=torch.Generator().manual_seed(noise_seed("layers.0.q_proj.lora_B", 7)),
                        dtype=torch.float32)
    assert torch.equal(first, fresh * 0.25) and torch.equal(again, fresh * 0.5)
    assert list(noise.draws) == ["layers.0.q_proj.lora_B"]
    other = noise.scaled("layers.0.q_proj.lora_B", (4, 3), 8, 0.25)
    assert noise.seed == 8 and not torch.equal(other, first)  # another seed: drawn anew, the old seed's dropped


def test_a_search_of_perturbs_leaves_b_as_one_fresh_perturb_would() -> None:
    cfg = config.load(None)
    model_dir = synthetic.materialize(cfg)
    searched, fresh = HFTrainer(cfg, model_dir, 0, {}), HFTrainer(cfg, model_dir, 0, {})
    for std in (0.01, 0.02, 0.04):  # as a calibration's search: zero B, perturb, score
        searched.zero_b()
        searched.perturb(std, 3, only="v_proj" if std == 0.02 else None)
    fresh.perturb(0.04, 3)
    assert all(torch.equal(a, b) for a, b in zip(_b(searched).values(), _b(fresh).values(), strict=True))
    searched.zero_b()
    searched.perturb(0.04, 4)
    fresh.zero_b()
    fresh.perturb(0.04, 4)
    assert all(torch.equal(a, b) for a, b in zip(_b(searched).values(), _b(fresh).values(), strict=True))
