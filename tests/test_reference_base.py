"""The references' one fp32 load per run and their LoRA without PEFT's modules (issue 47): the same scores as a
PEFT wrap, bit for bit; one read of the checkpoint where the device holds it, two where it does not; the exact
reference's layout from the tensors equal to the layout from PEFT's modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from lora_parity.backends import reference_base  # noqa: E402
from lora_parity.backends.fp32_points import fp32_points  # noqa: E402
from lora_parity.backends.hf import HFTrainer, fp32_reference  # noqa: E402
from lora_parity.backends.reference_base import ReferenceBase  # noqa: E402
from lora_parity.backends.zero_lora import zero_layers  # noqa: E402
from lora_parity.models import config, synthetic  # noqa: E402
from lora_parity.util.errors import ConfigError  # noqa: E402

SEQS = [[1, 5, 9, 17, 33, 2, 8], [4, 4, 7, 100, 3], [7, 3, 3, 21, 9, 14]]


def _bf16(tmp_path: Path) -> Any:
    """tiny-qwen3 in bf16, alpha/r 1.5 (a power of two would scale exactly in any order)."""
    text = (config.configs_dir() / "tiny-qwen3.yaml").read_text(encoding="utf-8")
    path = tmp_path / "tiny-qwen3-bf16.yaml"
    path.write_text(text.replace("name: tiny-qwen3", "name: tiny-qwen3-bf16")
                    .replace("dtype: float32", "dtype: bfloat16").replace("alpha: 16", "alpha: 12"), encoding="utf-8")
    return config.load(str(path))


def _points(trainer: HFTrainer) -> list[dict[str, Any]]:
    """The trainer's tensors at three points: zero-init, one target kind moved (the others' B zero), all moved."""
    zero = trainer.lora_tensors()
    trainer.perturb(0.05, 3, only="q_proj")
    one = trainer.lora_tensors()
    trainer.zero_b()
    trainer.perturb(0.05, 4)
    every = trainer.lora_tensors()
    trainer.zero_b()
    return [zero, one, every]


def test_plain_lora_on_the_shared_load_scores_as_a_peft_wrap_bit_for_bit(tmp_path: Path) -> None:
    cfg = _bf16(tmp_path)
    model_dir = synthetic.materialize(cfg)
    states = _points(HFTrainer(cfg, model_dir, 0, {}))
    own = fp32_points(cfg, model_dir)(SEQS, states)  # PEFT's wrap on a load of its own
    base = ReferenceBase(cfg, model_dir, torch.device("cpu"))
    start = fp32_reference(cfg, model_dir, base=base)(SEQS)
    assert base.held and base.loads == 1  # kept for the later points: this machine holds it
    shared = fp32_points(cfg, model_dir, base)(SEQS, states)
    assert shared == own and base.loads == 1
    assert start == own[0] and shared[1] != shared[0] != shared[2]  # each point its own, the start the base model
    base.release()
    assert not base.held


@pytest.mark.parametrize(("pack", "forwards"), [(2048, 1), (42, 2), (20, 6)])
def test_points_share_forwards_up_to_the_pack_and_each_keeps_its_own_rows(tmp_path: Path, pack: int,
                                                                          forwards: int) -> None:
    """`fp32_points` on the shared load packs points into a forward up to `scoring.pack_tokens` padded tokens: all
    three (3 sequences right-padded to 7: 21 tokens), two then one (42), or one a forward where the sequences
    themselves take two groups (20). On this CPU every way scores as a PEFT wrap per point does, bit for bit."""
    cfg = _bf16(tmp_path)
    cfg = cfg.model_copy(update={"scoring": cfg.scoring.model_copy(update={"pack_tokens": pack})})
    model_dir = synthetic.materialize(cfg)
    states = _points(HFTrainer(cfg, model_dir, 0, {}))
    base = ReferenceBase(cfg, model_dir, torch.device("cpu"))
    calls: list[int] = []
    base.model().register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0] if args else 0))
    shared = fp32_points(cfg, model_dir, base)(SEQS, states)
    assert len(calls) == forwards
    assert shared == fp32_points(cfg, model_dir)(SEQS, states)
    assert shared[1] != shared[0] != shared[2] != shared[1]  # no point took another's rows


def test_a_set_without_a_tensor_or_of_another_shape_is_refused_on_the_shared_load(tmp_path: Path) -> None:
    cfg = _bf16(tmp_path)
    model_dir = synthetic.materialize(cfg)
    state = HFTrainer(cfg, model_dir, 0, {}).lora_tensors()
    score = fp32_points(cfg, model_dir, ReferenceBase(cfg, model_dir, torch.device("cpu")))
    name = next(n for n in state if ".lora_B." in n)
    with pytest.raises(ConfigError, match=f"fp32 reference: the trainer's tensors have no {name}"):
        score(SEQS, [{k: v for k, v in state.items() if k != name}])
    dtype, shape, raw = state[name]
    wider = {**state, name: (dtype, [shape[0], shape[1] + 1], raw + bytes(4 * shape[0]))}
    with pytest.raises(ConfigError, match=f"fp32 reference: {name} is"):
        score(SEQS, [wider])


def test_the_load_is_not_kept_where_the_device_has_too_little_free(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _bf16(tmp_path)
    model_dir = synthetic.materialize(cfg)
    states = _points(HFTrainer(cfg, model_dir, 0, {}))
    monkeypatch.setattr(reference_base, "free_bytes", lambda device: 0)
    base = ReferenceBase(cfg, model_dir, torch.device("cpu"))
    fp32_reference(cfg, model_dir, base=base)(SEQS)
    assert not base.held
    assert fp32_points(cfg, model_dir, base)(SEQS, states) == fp32_points(cfg, model_dir)(SEQS, states)
    assert base.loads == 2


def test_a_start_adapter_keeps_its_own_load(tmp_path: Path) -> None:
    """The start point with the user's adapter wraps the base in PEFT: it is never the shared load."""
    cfg = _bf16(tmp_path)
    model_dir = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, model_dir, 0, {})
    trainer.perturb(0.05, 3)
    adapter = trainer.export_adapter(tmp_path / "adapter")
    base = ReferenceBase(cfg, model_dir, torch.device("cpu"))
    with_adapter = fp32_reference(cfg, model_dir, adapter, base)(SEQS)
    assert base.loads == 0 and with_adapter != fp32_reference(cfg, model_dir)(SEQS)


def test_the_runner_releases_the_shared_load_at_the_runs_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="vLLM (the 'cpu' extra) is not installed")
    from lora_parity.run.options import RunOptions
    from lora_parity.run.runner import execute

    cfg = _bf16(tmp_path)
    released: list[bool] = []
    release = ReferenceBase.release

    def spy(self: ReferenceBase) -> None:
        released.append(self.held)
        release(self)

    monkeypatch.setattr(ReferenceBase, "release", spy)
    receipt = execute(RunOptions(model=str(tmp_path / "tiny-qwen3-bf16.yaml"), sampler="hf", per_target=False,
                                 reference="fp32", out=tmp_path / "r.json")).receipt
    assert cfg.model.dtype == "bfloat16" and "reference_fp32" in receipt.scores
    assert "reference_fp32_updated" in receipt.scores and released and released[-1]  # held to the end, then freed


@pytest.mark.parametrize("rank", [8, 16])  # the adapter's own rank, and padded to a larger max_lora_rank
def test_the_exact_layout_from_the_tensors_equals_the_layout_from_peft(tmp_path: Path, rank: int) -> None:
    """`exact.StateGroups` (the fp32 load cast to bf16, the point's tensors as given) against `exact.layer_groups`
    (the trainer's PEFT modules in bf16): every base weight, A and B slice equal."""
    from lora_parity.backends.exact import StateGroups, layer_groups
    from lora_parity.backends.hf import load_base
    from lora_parity.backends.reference_base import lora_pairs, plain_targets, scaling

    cfg = _bf16(tmp_path)
    model_dir = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, model_dir, 0, {})
    plain = load_base(cfg, model_dir, torch.device("cpu"), dtype="float32")
    targets = plain_targets(cfg, plain)
    assert targets is not None and len(targets) == 7 * len(plain.model.layers)
    state = StateGroups(plain, rank, torch.bfloat16)
    peft_layers = trainer.model.get_base_model().model.layers
    for only in (None, "v_proj"):  # every B non-zero; one target kind's alone (the others' B exactly zero)
        trainer.zero_b()
        trainer.perturb(0.05, 3, only=only)
        zero = frozenset(map(id, zero_layers(trainer.model)))
        pairs = lora_pairs(trainer.lora_tensors(), targets, "exact reference", torch.device("cpu"), torch.bfloat16)
        groups_of = state.of(pairs, scaling(cfg))
        for index, layer in enumerate(plain.model.layers):
            ours, theirs = groups_of(index, layer), layer_groups(peft_layers[index], rank, zero)
            for name in ("qkv", "o", "gate_up", "down"):
                assert torch.equal(ours[name].weight, theirs[name].weight), name
                assert (ours[name].a is None) == (theirs[name].a is None) == (only is not None and name != "qkv")
                for x, y in zip(ours[name].a or (), theirs[name].a or (), strict=True):
                    assert torch.equal(x, y)
                for x, y in zip(ours[name].b or (), theirs[name].b or (), strict=True):
                    assert torch.equal(x, y)
            assert ours["qkv"].b is not None and ours["qkv"].b[2].any()
            assert ours["qkv"].b[0].any() == (only is None)  # q_proj's slice: zero (its A too) where B is zero
    embed = trainer.model.get_base_model().model.embed_tokens.weight
    assert torch.equal(state.cast(plain.model.embed_tokens.weight), embed)


def test_a_zero_b_slice_adds_what_the_engine_adds_and_a_written_b_is_seen(tmp_path: Path) -> None:
    """A layer whose B is exactly zero is laid out without its A (`StateGroups.of`, `layer_groups` with
    `zero_lora.zero_layers`): the LoRA term of the slices (x A^T, then B^T, as the shrink and expand kernels) is the
    same zero either way; and one subnormal written into such a B (no square to underflow) brings the layer back."""
    from lora_parity.backends.exact import StateGroups, layer_groups
    from lora_parity.backends.hf import load_base
    from lora_parity.backends.reference_base import lora_pairs, plain_targets, scaling

    cfg = _bf16(tmp_path)
    model_dir = synthetic.materialize(cfg)
    trainer = HFTrainer(cfg, model_dir, 0, {})
    trainer.perturb(0.05, 3, only="q_proj")
    plain = load_base(cfg, model_dir, torch.device("cpu"), dtype="float32")
    targets = plain_targets(cfg, plain)
    assert targets is not None
    layer = trainer.model.get_base_model().model.layers[1]
    skipped = layer_groups(layer, 8, frozenset(map(id, zero_layers(trainer.model))))["qkv"]
    full = layer_groups(layer, 8)["qkv"]
    x = torch.randn(5, full.weight.shape[1], dtype=torch.bfloat16)
    assert skipped.a is not None and skipped.b is not None and full.a is not None and full.b is not None
    for ours, theirs in zip(zip(skipped.a, skipped.b, strict=True), zip(full.a, full.b, strict=True), strict=True):
        term = [(x.float() @ a[0, 0].float().T) @ b[0, 0].float().T for a, b in (ours, theirs)]
        assert torch.equal(term[0], term[1])
    assert not skipped.a[1].any() and full.a[1].any()  # k_proj: B zero, so its A is left out
    with torch.no_grad():
        layer.self_attn.o_proj.lora_B["default"].weight[0, 0] = 1e-40  # a subnormal: its square underflows
    assert layer_groups(layer, 8, frozenset(map(id, zero_layers(trainer.model))))["o"].a is not None
    pairs = lora_pairs(trainer.lora_tensors(), targets, "exact reference", torch.device("cpu"), torch.bfloat16)
    groups = StateGroups(plain, 8, torch.bfloat16).of(pairs, scaling(cfg))
    assert groups(1, plain.model.layers[1])["o"].a is not None and groups(0, plain.model.layers[0])["o"].a is None


def test_the_page_layout_is_made_once_as_vllm_lays_out_a_prefill() -> None:
    """`exact.Pages`: blocks of 16 in sequence order, each sequence's slots from its first block, the starts and
    lengths as FlashAttention's varlen arguments take them."""
    from lora_parity.backends.exact import Pages

    pages = Pages([5, 20, 16], torch.device("cpu"))
    assert pages.blocks == 4 and pages.table.tolist() == [[0, 0], [1, 2], [3, 0]]
    assert pages.slots.tolist() == [*range(5), *range(16, 36), *range(48, 64)]
    assert pages.starts.tolist() == [0, 5, 25, 41] and pages.used.tolist() == [5, 20, 16]
    assert pages.table.dtype == pages.starts.dtype == pages.used.dtype == torch.int32
    assert pages.slots.dtype == torch.int64


def test_the_export_writes_what_peft_writes_byte_for_byte(tmp_path: Path) -> None:
    """`adapter_export`: the first export is PEFT's save (the LoRA tensors given in one host copy), each later one
    writes the same files itself; every one equals PEFT's own save of the same state, byte for byte."""
    cfg = _bf16(tmp_path)
    trainer = HFTrainer(cfg, synthetic.materialize(cfg), 0, {})
    for i, (std, seed) in enumerate([(0.05, 3), (0.07, 5), (0.0, 0)]):
        trainer.zero_b()
        if std:
            trainer.perturb(std, seed)
        ours = trainer.export_adapter(tmp_path / f"ours-{i}")
        trainer.model.save_pretrained(str(tmp_path / f"peft-{i}"), safe_serialization=True)
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert (ours / name).read_bytes() == (tmp_path / f"peft-{i}" / name).read_bytes(), (i, name)
        assert sorted(p.name for p in ours.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert trainer.writer._direct  # the later ones were written without PEFT


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
def test_write_safetensors_is_save_file_byte_for_byte(tmp_path: Path, dtype: str) -> None:
    """`adapter_export.write_safetensors`: the data ordered by name, the header's entries in that order after the
    metadata, compact and padded to 8 bytes, as `save_file`; tensors of several dtypes or an odd name are left to it."""
    from safetensors.torch import save_file

    from lora_parity.backends.adapter_export import write_safetensors

    gen = torch.Generator().manual_seed(0)
    named = [(name, torch.randn(shape, generator=gen).to(getattr(torch, dtype)))
             for name, shape in [("b.lora_B.weight", (6, 2)), ("a.lora_A.weight", (2, 6)), ("a.lora_B.weight", (3, 2)),
                                 ("a.b.c", (5,)), ("z", (1, 1, 3))]]
    for count in (1, 2, 5):
        assert write_safetensors(tmp_path / "ours", named[:count], {"format": "pt"})
        save_file(dict(named[:count]), str(tmp_path / "theirs"), metadata={"format": "pt"})
        assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes(), count
    mixed = [*named[:2], ("c", torch.zeros(2, dtype=torch.int32 if dtype != "int32" else torch.float32))]
    assert not write_safetensors(tmp_path / "mixed", mixed, {"format": "pt"}) and not (tmp_path / "mixed").exists()
    assert not write_safetensors(tmp_path / "odd", [('a"b', named[0][1])], {"format": "pt"})


@pytest.mark.parametrize(("stored", "wanted"),
                         [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float16")])
def test_views_on_gives_copy_raw_s_values(stored: str, wanted: str) -> None:
    """`raw_tensors.views_on` (one transfer and one cast per stored dtype, views of it) gives the values `copy_raw`
    writes into tensors of their own, bit for bit; a state whose bytes do not fill the shapes is refused."""
    from lora_parity.backends.raw_tensors import copy_raw, to_raw_all, views_on
    from lora_parity.util.errors import ConfigError

    gen = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": (torch.randn(shape, generator=gen) * 3).to(getattr(torch, stored))
               for i, shape in enumerate([(4, 3), (2,), (3, 1, 2)])}
    state = to_raw_all(tensors.items())
    views = views_on(state, list(state), torch.device("cpu"), getattr(torch, wanted))
    params = {n: torch.empty(list(state[n][1]), dtype=getattr(torch, wanted)) for n in state}
    copy_raw(params, state, torch.device("cpu"))
    assert all(torch.equal(views[n].view(torch.uint8), params[n].view(torch.uint8)) for n in state)
    assert [list(v.shape) for v in views.values()] == [[4, 3], [2], [3, 1, 2]]
    short = {**state, "t1": (state["t1"][0], [3], state["t1"][2])}
    with pytest.raises(ConfigError, match="hold 20 values where their shapes need 21"):
        views_on(short, list(short), torch.device("cpu"), torch.float32)
