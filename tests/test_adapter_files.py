import math
from pathlib import Path

import pytest

from lora_parity.models import adapter_files as af
from lora_parity.models.perturb import is_lora_b, logical_name, noise_seed, target_kind

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", ["F32", "F64", "F16", "BF16"])
def test_safetensors_round_trip_and_negate(dtype: str, tmp_path: Path) -> None:
    values = [0.5, -1.25, 0.0, 2.0]
    t = af.Tensor.from_floats(dtype, [2, 2], values)
    af.write_safetensors(tmp_path / "t.safetensors", {"x": t})
    back, _ = af.read_safetensors(tmp_path / "t.safetensors")
    assert back["x"].to_floats() == values and back["x"].shape == [2, 2]
    assert af.negate(back["x"]).to_floats() == [-v if v else -0.0 for v in values]


def test_files_load_in_the_safetensors_library(tmp_path: Path) -> None:
    numpy = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    af.write_safetensors(tmp_path / "t.safetensors", {"a": af.Tensor.from_floats("F32", [3], [1.0, 2.0, 3.0])})
    loaded = st.load_file(str(tmp_path / "t.safetensors"))
    assert numpy.array_equal(loaded["a"], numpy.array([1.0, 2.0, 3.0], dtype=numpy.float32))


def test_peft_names() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert logical_name(name) == "model.layers.0.self_attn.q_proj.lora_B"
    assert logical_name("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight") == logical_name(name)
    assert target_kind(name) == "q_proj" and is_lora_b(name) and not is_lora_b(name.replace("lora_B", "lora_A"))
    # The exported file's name and the live parameter's name seed the same noise.
    assert noise_seed(name, 3) == noise_seed(name.replace(".default", ""), 3) != noise_seed(name, 4)
    assert 0 <= noise_seed(name, 0) < 2**63
    assert not math.isnan(noise_seed(name, 0))


def test_add_noise_matches_one_add_per_tensor_bit_for_bit() -> None:
    """The perturbation's batched copy (one per device and dtype) adds exactly what one add per tensor did."""
    import torch

    from lora_parity.models.perturb import add_noise

    targets = [torch.zeros(3, 4, dtype=torch.bfloat16), torch.ones(5, dtype=torch.float32),
               torch.full((2, 2), 0.5, dtype=torch.bfloat16)]
    noises = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float32) * 0.02
              for i, t in enumerate(targets)]
    expected = [t.clone().add_(n.to(dtype=t.dtype)) for t, n in zip(targets, noises, strict=True)]
    add_noise(list(zip(targets, noises, strict=True)))
    for got, want in zip(targets, expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
