"""LoRA layers adding exactly zero left out of a scoring forward (issue 47): which layers are skipped, read off the
tensors' values now, and the scores bit for bit those of the whole forward."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def trainer() -> Any:
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.models import config, synthetic

    cfg = config.load(None)
    return HFTrainer(cfg, synthetic.materialize(cfg), 0, {})


SEQUENCES = [[3, 17, 5, 9, 40, 2, 11], [8, 1, 22, 4]]


def _whole(trainer: Any) -> Any:
    """The trainer's scores with no layer skipped."""
    from lora_parity.backends import zero_lora

    found = zero_lora.zero_layers
    zero_lora.zero_layers = lambda model: []
    try:
        return trainer.score(SEQUENCES)
    finally:
        zero_lora.zero_layers = found


def _layers(trainer: Any) -> list[Any]:
    from lora_parity.backends import zero_lora

    return zero_lora.lora_linears(trainer.model)


def _kinds(layers: list[Any], trainer: Any) -> set[str]:
    names = {id(m): n for n, m in trainer.model.named_modules()}
    return {names[id(layer)].rsplit(".", 1)[-1] for layer in layers}


def test_zero_init_skips_every_layer_and_scores_the_same(trainer: Any) -> None:
    from lora_parity.backends import zero_lora

    trainer.zero_b()
    skipped = zero_lora.zero_layers(trainer.model)
    assert skipped and len(skipped) == len(_layers(trainer))
    seen: list[bool] = []
    hook = _layers(trainer)[0].register_forward_hook(lambda module, args, out: seen.append(module.disable_adapters))
    try:
        scores = trainer.score(SEQUENCES)
    finally:
        hook.remove()
    assert seen and all(seen)  # the trainer's own forward ran the layer's base alone
    assert scores == _whole(trainer)
    assert not any(layer.disable_adapters for layer in _layers(trainer))  # turned back on after the forward


def test_one_target_kind_perturbed_keeps_that_kind_only(trainer: Any) -> None:
    from lora_parity.backends import zero_lora

    trainer.zero_b()
    trainer.perturb(0.05, 3, only="q_proj")
    try:
        skipped = zero_lora.zero_layers(trainer.model)
        kept = [layer for layer in _layers(trainer) if layer not in skipped]
        assert _kinds(kept, trainer) == {"q_proj"} and "q_proj" not in _kinds(skipped, trainer)
        moved = trainer.score(SEQUENCES)
        assert moved == _whole(trainer)
    finally:
        trainer.zero_b()
    assert moved != trainer.score(SEQUENCES)  # the perturbed kind was not skipped: it moved the scores


@pytest.mark.parametrize("value", [1e-40, float("nan"), float("inf"), -3.0])
def test_a_b_written_behind_the_trainer_s_back_is_seen(trainer: Any, value: float) -> None:
    """The fault case: a B changed by no trainer method (a subnormal, a NaN, an infinity, a plain value) is not
    zero, so its layer runs whole and the forward says so."""
    from lora_parity.backends import zero_lora

    trainer.zero_b()
    layer = _layers(trainer)[2]
    with torch.no_grad():
        layer.lora_B["default"].weight[0, 0] = value
    try:
        assert layer not in zero_lora.zero_layers(trainer.model)
        assert len(zero_lora.zero_layers(trainer.model)) == len(_layers(trainer)) - 1
        if value == -3.0:
            assert trainer.score(SEQUENCES) == _whole(trainer) != _zero_scores(trainer)
    finally:
        trainer.zero_b()


def _zero_scores(trainer: Any) -> Any:
    held = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.zero_b()
    out = trainer.score(SEQUENCES)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if n in held:
                p.copy_(held[n])
    return out


def test_the_adapters_come_back_on_after_a_failed_forward(trainer: Any) -> None:
    from lora_parity.backends import zero_lora

    trainer.zero_b()
    with pytest.raises(RuntimeError), zero_lora.skipped(trainer.model) as count:
        assert count == len(_layers(trainer)) and all(layer.disable_adapters for layer in _layers(trainer))
        raise RuntimeError("the forward failed")
    assert not any(layer.disable_adapters for layer in _layers(trainer))


def test_dora_and_merged_layers_are_never_skipped() -> None:
    import peft

    from lora_parity.backends import zero_lora

    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    dora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "1"], use_dora=True,
                                                     init_lora_weights=False))
    with torch.no_grad():
        for n, p in dora.named_parameters():
            if "lora_B" in n:
                p.zero_()
    assert zero_lora.zero_layers(dora) == []  # B is zero, but DoRA's magnitude still rescales

    plain = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                peft.LoraConfig(r=2, target_modules=["0", "1"]))
    assert len(zero_lora.zero_layers(plain)) == 2  # PEFT's own init: B zero
    plain.base_model.model[0].merge()
    assert len(zero_lora.zero_layers(plain)) == 1


def test_perturb_reaches_the_kind_and_layers_asked_for_each_time(trainer: Any) -> None:
    """The HF trainer's B lists are found once per (kind, layers): a perturb inside `restricted_to` moves only those
    layers' B of that kind, one outside it the kind's B in every layer, and one of all kinds every B."""
    from lora_parity.backends.layer_subset import layer_of
    from lora_parity.models.perturb import is_lora_b, target_kind

    def moved() -> set[tuple[str, int]]:
        return {(target_kind(n), layer_of(n)) for n, p in trainer.model.named_parameters() if is_lora_b(n) and p.any()}

    layers = trainer.layers()
    for _ in range(2):  # the second time from the kept lists
        trainer.zero_b()
        with trainer.restricted_to(layers[:1]):
            trainer.perturb(0.02, 1, only="q_proj")
        assert moved() == {("q_proj", layers[0])}
        trainer.zero_b()
        trainer.perturb(0.02, 1, only="q_proj")
        assert moved() == {("q_proj", layer) for layer in layers}
        trainer.zero_b()
        trainer.perturb(0.02, 1)
        assert {kind for kind, _ in moved()} == set(trainer.cfg.adapter.targets) and len(layers) > 1
    trainer.zero_b()
