"""The HF trainer's adapter export (issue 47: PEFT's model card was two thirds of each save): the weights and
adapter_config.json as PEFT saves them, no README.md, and PEFT loads the folder back to the trainer's tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import from_raw

pytestmark = pytest.mark.unit


def test_the_export_is_peft_s_adapter_without_the_model_card(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from lora_parity.backends.hf import HFTrainer, load_base
    from lora_parity.models import config, synthetic

    cfg = config.load(None)
    ckpt = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, ckpt, 0, {})
    trainer.perturb(0.02, 0)
    held = trainer.lora_tensors()
    for name in ("v0", "v1"):  # the second save as the first: the shadowed card stays shadowed
        folder = trainer.export_adapter(tmp_path / name)
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        saved = load_file(str(folder / "adapter_model.safetensors"))
        assert set(saved) == set(held) and any(bool(t.any()) for k, t in saved.items() if "lora_B" in k)
        assert all(torch.equal(saved[k], from_raw(held[k])) for k in held)
    loaded = peft.PeftModel.from_pretrained(load_base(cfg, ckpt, torch.device("cpu")), str(tmp_path / "v1"))
    back = {n.replace(".default.weight", ".weight"): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(back) == set(held) and all(torch.equal(back[k], from_raw(held[k]).to(back[k].dtype)) for k in held)

