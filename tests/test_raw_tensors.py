"""LoRA tensors to the host and back in one transfer per dtype (issue 47: one wait per tensor on a GPU): the same
bytes as one tensor at a time, and a short buffer refused."""

from __future__ import annotations

import pytest

from tests.conftest import from_raw

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")


def _tensors() -> list[tuple[str, object]]:
    g = torch.Generator().manual_seed(0)
    return [("a.lora_A", torch.randn(4, 6, generator=g).bfloat16()), ("a.lora_B", torch.randn(6, 4, generator=g)),
            ("b.lora_A", torch.randn(2, 3, generator=g).bfloat16()[:, :2]),  # not contiguous
            ("b.lora_B", torch.randn(5, generator=g).double())]


def test_to_raw_all_holds_each_tensor_s_own_bytes_in_order() -> None:
    from lora_parity.backends.raw_tensors import DTYPES, to_raw_all

    named = _tensors()
    together = to_raw_all(named)
    assert list(together) == [n for n, _ in named]
    assert together == {n: (DTYPES[t.dtype], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                        for n, t in named}


def test_copy_raw_sets_each_parameter_cast_to_its_dtype() -> None:
    from lora_parity.backends.raw_tensors import copy_raw, to_raw_all

    named = _tensors()
    state = to_raw_all(named)
    params = {n: torch.zeros(t.shape, dtype=torch.float32) for n, t in named}
    copy_raw(params, state, torch.device("cpu"))
    for name, _ in named:
        assert torch.equal(params[name], from_raw(state[name]).to(torch.float32))


def test_copy_raw_refuses_a_buffer_that_does_not_fill_the_shapes() -> None:
    from lora_parity.backends.raw_tensors import copy_raw, to_raw_all
    from lora_parity.util.errors import ConfigError

    named = _tensors()
    state = to_raw_all(named)
    dtype, shape, data = state["a.lora_B"]
    state["a.lora_B"] = (dtype, shape, data[:-4])
    with pytest.raises(ConfigError, match="F32 tensors given hold 23 values where their shapes need 24"):
        copy_raw({n: torch.zeros(t.shape) for n, t in named}, state, torch.device("cpu"))

