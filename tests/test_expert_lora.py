"""Expert LoRA (docs/moe.md, "Expert LoRA"): `adapter.target_parameters` in the config, the routed experts' target
kinds, PEFT's fused expert layout (expert e's B columns `e::E`), the expert-dropped fault and its naming, and the
preflight that refuses every sampler but the HF one and vLLM on CUDA, vLLM's settings for PEFT's fused file
(unit); PEFT's merge and the HF trainer and sampler on tiny-qwen3-moe-experts (cpu_e2e: torch, transformers, PEFT;
no vLLM)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import yaml

from lora_parity.evidence import receipt as rc
from lora_parity.models import adapter_files as af
from lora_parity.models import config, export_check
from lora_parity.models.adapter_spec import EXPERT_KINDS, EXPERT_PARAMETERS, AdapterSpec
from lora_parity.models.perturb import target_kind
from lora_parity.run import preflight
from lora_parity.run.faults import FAULTS, Faults, faults_for
from lora_parity.run.moe_faults import EXPERT_DROPPED, drop_expert
from lora_parity.run.options import RunOptions
from lora_parity.util.errors import ConfigError, PhaseError
from lora_parity.verdict import findings

from .conftest import ROOT, cli

unit = pytest.mark.unit
cpu_e2e = pytest.mark.cpu_e2e

MODEL = "tiny-qwen3-moe-experts"
PREFIX = "base_model.model.model.layers"


def _config_with(tmp_path: Path, target_parameters: object) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "tiny-qwen3-moe.yaml").read_text(encoding="utf-8"))
    data["adapter"]["target_parameters"] = target_parameters
    path = tmp_path / "experts.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


# ---------- unit: the config field ----------

@unit
def test_the_expert_config_names_both_fused_parameters_and_their_kinds() -> None:
    cfg = config.load(MODEL)
    assert cfg.adapter.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert cfg.adapter.kinds == ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]
    assert config.load("tiny-qwen3-moe").adapter.kinds == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert config.AdapterSpec is AdapterSpec  # re-exported where the rest of the code imports it


@unit
@pytest.mark.parametrize("value", [["mlp.experts.down_proj", "mlp.experts.gate_up_proj"], ["mlp.experts.down_proj"],
                                   ["mlp.experts.gate_up_proj"], ["mlp.gate.weight", "mlp.experts.down_proj"],
                                   [*EXPERT_PARAMETERS, "mlp.experts.down_proj"], "mlp.experts.gate_up_proj"])
def test_any_other_target_parameters_are_refused_in_one_line(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"invalid config: adapter.*target_parameters") as caught:
        config.load(str(_config_with(tmp_path, value)))
    assert "\n" not in str(caught.value)


@unit
def test_the_digest_leaves_an_empty_target_parameters_out(tmp_path: Path) -> None:
    cfg = config.load("tiny-qwen3-moe")
    dump = cfg.model_dump(mode="json", exclude={"route_replay"})
    assert "target_parameters" in dump["adapter"] and dump["adapter"].pop("target_parameters") == []
    dump["sampler"].pop("sampling")  # the identity sampling is left out too (tests/test_sampling.py)
    dump["sampler"].pop("loop")  # and lora-parity's own loop (tests/test_loop.py)
    assert cfg.digest() == rc.sha256_json(dump)  # as before the field existed: older digests hold
    empty = config.load(str(_config_with(tmp_path, [])))
    assert empty.adapter.target_parameters == [] and empty.digest() == cfg.digest()
    experts = config.load(str(_config_with(tmp_path, list(EXPERT_PARAMETERS))))
    assert experts.digest() != cfg.digest()


# ---------- unit: target kinds ----------

@unit
def test_the_expert_wrappers_read_as_the_parameters_they_wrap() -> None:
    assert target_kind(f"{PREFIX}.0.mlp.experts.base_layer.lora_A.default.weight") == "experts.gate_up_proj"
    assert target_kind(f"{PREFIX}.0.mlp.experts.base_layer.lora_B.weight") == "experts.gate_up_proj"
    assert target_kind(f"{PREFIX}.1.mlp.experts.lora_B.default.weight") == "experts.down_proj"
    assert target_kind(f"{PREFIX}.1.mlp.experts.lora_A.weight") == "experts.down_proj"
    assert target_kind(f"{PREFIX}.1.self_attn.q_proj.lora_B.default.weight") == "q_proj"
    assert target_kind(f"{PREFIX}.1.mlp.down_proj.lora_B.weight") == "down_proj"  # a dense MLP is its module


# ---------- unit: the fault on PEFT's fused layout ----------

E, R, OUT = 4, 2, 3  # experts, rank, B's rows


def _b(layer: int, wrapper: str, fill: float = 1.0) -> tuple[str, af.Tensor]:
    values = [fill + 0.01 * i for i in range(OUT * E * R)]
    return f"{PREFIX}.{layer}.mlp.experts.{wrapper}lora_B.weight", af.Tensor.from_floats("F32", [OUT, E * R], values)


def _adapter(layers: int = 3) -> dict[str, af.Tensor]:
    tensors = dict(_b(i, w) for i in range(layers) for w in ("base_layer.", ""))
    tensors[f"{PREFIX}.1.mlp.experts.lora_A.weight"] = af.Tensor.from_floats("F32", [E * R, 5], [1.0] * E * R * 5)
    tensors[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] = af.Tensor.from_floats("F32", [4, R], [1.0] * 4 * R)
    return tensors


def _routes(layer_experts: list[list[int]]) -> list:
    """One sequence whose tokens take, in every one of 3 MoE layers, the top-2 given per token."""
    return [[[pair, pair, pair] for pair in ([e, (e + 1) % E] for e in expert_per_token)]
            for expert_per_token in layer_experts]


@unit
def test_the_fault_zeroes_the_most_visited_experts_columns_of_both_b_in_the_middle_layer() -> None:
    tensors = _adapter()
    # Expert 2 is taken by three tokens (2 with 3, 1 with 2, 2 with 3), expert 3 by two: expert 2 is dropped.
    dropped = drop_expert(tensors, R, _routes([[2, 1, 2]]))
    for name, t in tensors.items():
        after = dropped[name].to_floats()
        if ".layers.1.mlp.experts." in name and ".lora_B" in name:
            cols = E * R
            assert [after[i] for i in range(len(after)) if i % cols % E == 2] == [0.0] * OUT * R
            assert [a for i, a in enumerate(after) if i % cols % E != 2] == \
                [v for i, v in enumerate(t.to_floats()) if i % cols % E != 2]
        else:  # the other layers, A and the attention stay as exported
            assert dropped[name] == t, name
    # Ties go to the lowest index; without the engine's routes, or on an adapter without experts, it says so.
    tied = drop_expert(tensors, R, _routes([[3, 0]]))  # experts 3, 0, 0, 1: expert 0
    assert tied[f"{PREFIX}.1.mlp.experts.lora_B.weight"].to_floats()[0] == 0.0
    with pytest.raises(PhaseError, match="no engine routes"):
        drop_expert(tensors, R, None)
    with pytest.raises(PhaseError, match="no routed-expert tensors"):
        attention = f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"
        drop_expert({attention: tensors[attention]}, R, _routes([[1]]))


@unit
def test_the_file_check_names_layer_modules_and_expert(tmp_path: Path) -> None:
    tensors = _adapter()
    raw = {n: (t.dtype, list(t.shape), t.data) for n, t in tensors.items()}
    folder = tmp_path / "a"
    af.write_adapter(folder, {"r": R, "lora_alpha": 4}, drop_expert(tensors, R, _routes([[3, 2]])))
    assert export_check.differences(folder, raw, R, 4.0) == [
        "2 tensors with other values: layer 1; modules experts.down_proj, experts.gate_up_proj (lora_B); expert 3"]
    # An A with one expert's rows moved is named by its rows (e*r:(e+1)*r); the attention keeps its plain name.
    a_name = f"{PREFIX}.1.mlp.experts.lora_A.weight"
    moved = tensors[a_name].to_floats()
    moved[1 * R * 5 + 3] = 9.0  # in row 2: expert 1's first (its rows are 2-3)
    af.write_adapter(folder, {"r": R, "lora_alpha": 4}, {**tensors, a_name: af.Tensor.from_floats("F32", [E * R, 5],
                                                                                                   moved)})
    assert export_check.differences(folder, raw, R, 4.0) == [
        "1 tensors with other values: layer 1; modules experts.down_proj (lora_A); expert 1"]
    assert export_check.where([f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"]) == "layer 1; modules q_proj (lora_B)"


@unit
def test_the_fault_needs_expert_targets_and_route_replay() -> None:
    spec = FAULTS[EXPERT_DROPPED]
    assert spec.caught_by == ("X.sync.identical",) and spec.rewrites_files and spec.needs_replay
    kinds = config.load(MODEL).adapter.kinds
    assert EXPERT_DROPPED in faults_for("new-id", targets=kinds, replays=True)
    assert EXPERT_DROPPED not in faults_for("new-id", targets=kinds, replays=False)
    assert EXPERT_DROPPED not in faults_for("new-id", targets=config.load("tiny-qwen3-moe").adapter.kinds,
                                            replays=True)
    with pytest.raises(ConfigError, match=r"needs target modules experts\.gate_up_proj, experts\.down_proj"):
        Faults(EXPERT_DROPPED, ["q_proj"], 10, 1e-4)
    Faults(EXPERT_DROPPED, kinds, 10, 1e-4)  # taken where the adapter has them


# ---------- unit: preflight ----------

@unit
@pytest.mark.parametrize(("trainer", "sampler"), [("hf", "sglang"), ("fake", "fake"), ("tinker", "tinker")])
def test_every_sampler_but_hf_and_vllm_is_refused_in_one_line(trainer: str, sampler: str) -> None:
    cfg = config.load(MODEL)
    with pytest.raises(ConfigError, match=f"adapter.target_parameters.*--sampler {sampler} cannot apply it") as e:
        preflight.check_options(RunOptions(model=MODEL, trainer=trainer, sampler=sampler), cfg)
    assert "\n" not in str(e.value) and "use --sampler hf" in str(e.value)
    preflight.check_options(RunOptions(model=MODEL, trainer="hf", sampler="hf"), cfg)
    for opts, says in ((RunOptions(model=MODEL, trainer="fake", sampler="hf"), "--trainer fake does not build it"),
                       (RunOptions(model=MODEL, sampler="hf", sync="merged"), "--sync merged does not publish it")):
        with pytest.raises(ConfigError, match=says):
            preflight.check_options(opts, cfg)


@unit
@pytest.mark.parametrize("sampler", ["vllm", "vllm-server"])
def test_vllm_applies_expert_lora_on_cuda_only(sampler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config.load(MODEL)
    opts = RunOptions(model=MODEL, trainer="hf", sampler=sampler)
    monkeypatch.setattr(preflight, "no_cuda_here", lambda: True)
    with pytest.raises(ConfigError, match=f"--sampler {sampler} applies it on CUDA only") as e:
        preflight.expert_lora_preflight(opts, cfg)
    assert "\n" not in str(e.value) and "use --sampler hf" in str(e.value)
    monkeypatch.setattr(preflight, "no_cuda_here", lambda: False)
    preflight.expert_lora_preflight(opts, cfg)  # on a GPU machine: taken


@unit
def test_vllm_loads_peft_fused_expert_file_as_saved() -> None:
    """The engine: `experts` among the LoRA modules and the mixed MoE format on (in process and served); each load
    declares the 3D layout (`is_3d_lora_weight`). A config without expert LoRA sets none of it."""
    from lora_parity.backends.engine_args import OWNED
    from lora_parity.backends.vllm import VLLMSampler
    from lora_parity.backends.vllm_options import engine_options
    from lora_parity.backends.vllm_server import server_argv

    experts, plain = config.load(MODEL), config.load("tiny-qwen3-moe")
    options = engine_options(experts, "ckpt", cuda=True)
    assert options["lora_target_modules"] == [*experts.adapter.targets, "experts"]
    assert options["enable_mixed_moe_lora_format"] is True and "enable_mixed_moe_lora_format" in OWNED
    assert "enable_mixed_moe_lora_format" not in engine_options(plain, "ckpt", cuda=True)
    assert engine_options(plain, "ckpt", cuda=True)["lora_target_modules"] == list(plain.adapter.targets)
    argv = server_argv(experts, Path("ckpt"), 8123, cuda=True)
    assert "--enable-mixed-moe-lora-format" in argv and "experts" in argv[argv.index("--lora-target-modules"):]
    assert "--enable-mixed-moe-lora-format" not in server_argv(plain, Path("ckpt"), 8123, cuda=True)

    from vllm.lora.request import LoRARequest

    from lora_parity.backends.base import AdapterHandle

    requests = []
    for cfg in (experts, plain):
        sampler = VLLMSampler.__new__(VLLMSampler)
        sampler.cfg, sampler._LoRARequest = cfg, LoRARequest
        requests.append(sampler._request(AdapterHandle("v1", 1, Path("adapter"))))
    assert [r.is_3d_lora_weight for r in requests] == [True, False]


@unit
def test_the_cli_refuses_the_default_sampler_here_before_loading_anything() -> None:
    done = cli("run", "--model", MODEL)  # vLLM-CPU: no MoE-LoRA kernel
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("lora-parity: error: adapter.target_parameters (expert LoRA): --sampler vllm applies "
                                "it on CUDA only")


# ---------- cpu_e2e: PEFT's layout, the HF trainer and sampler ----------

@cpu_e2e
def test_zeroing_an_experts_b_columns_removes_exactly_its_delta_from_peft_merge(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lora_parity.models import fresh_adapter
    from lora_parity.models.adapter_spec import peft_config

    experts, rank = 4, 2
    hf = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        num_experts=experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    base = Qwen3MoeForCausalLM(hf).eval()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    spec = AdapterSpec(rank=rank, alpha=4, targets=["q_proj"], target_parameters=list(EXPERT_PARAMETERS))
    model = peft.get_peft_model(base, peft_config(spec)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path / "full"))
    assert {target_kind(n) for n, _ in model.named_parameters() if "lora_" in n} == {"q_proj", *EXPERT_KINDS}

    config_json, tensors = af.read_adapter(tmp_path / "full")
    dropped = drop_expert(tensors, rank, [[[[2, 3]] * 3, [[2, 0]] * 3]])  # expert 2 in the middle layer (1)
    af.write_adapter(tmp_path / "dropped", config_json, dropped)
    # lora-parity's own writer (the exact check's fresh adapter) carries target_parameters: PEFT loads every tensor.
    raw = {n: (t.dtype, list(t.shape), t.data) for n, t in tensors.items()}
    fresh_adapter.write(tmp_path / "fresh", raw, rank, 4.0, ["q_proj"], spec.target_parameters)

    def merged(folder: Path) -> dict:
        m = Qwen3MoeForCausalLM(hf).eval()
        m.load_state_dict(state)
        return peft.PeftModel.from_pretrained(m, str(folder)).merge_and_unload().state_dict()

    full, without, fresh = merged(tmp_path / "full"), merged(tmp_path / "dropped"), merged(tmp_path / "fresh")
    for param in ("gate_up_proj", "down_proj"):
        for layer in range(3):
            key = f"model.layers.{layer}.mlp.experts.{param}"
            assert torch.equal(fresh[key], full[key])
            for e in range(experts):
                if (layer, e) == (1, 2):  # exactly its delta removed: the base weights again
                    assert (full[key][e] - state[key][e]).abs().max() > 0.1
                    assert torch.allclose(without[key][e], state[key][e], rtol=0, atol=1e-6)
                else:
                    assert torch.equal(without[key][e], full[key][e]), (key, e)
    assert export_check.differences(tmp_path / "dropped", raw, rank, 4.0) == [
        "2 tensors with other values: layer 1; modules experts.down_proj, experts.gate_up_proj (lora_B); expert 2"]
    assert struct.unpack("<f", dropped[f"{PREFIX}.1.mlp.experts.lora_B.weight"].data[8:12])[0] == 0.0  # column 2


@cpu_e2e
def test_hf_runs_pass_clean_and_catch_and_name_the_dropped_expert_in_every_seed(tmp_path: Path) -> None:
    from lora_parity.run.selftest import selftest

    result = selftest(RunOptions(model=MODEL, trainer="hf", sampler="hf"), tmp_path, faults=[EXPERT_DROPPED], seeds=2)
    assert result.ok, [r for r in result.rows if not r.caught]
    assert [r.fault for r in result.rows] == ["none", EXPERT_DROPPED] * 2
    for seed in ("seed-00", "seed-01"):
        clean = rc.load(tmp_path / seed / "clean.json")[0]
        assert clean.verdict == rc.Verdict.PASS and clean.route_replay is not None
        assert clean.route_replay.status == "replayed"
        status = {c.id: c.status for c in clean.checks}  # per-target coverage takes the expert kinds
        assert status["T.experts.gate_up_proj.moved"] == status["T.experts.down_proj.slope"] == rc.CheckStatus.PASS
        fault = rc.load(tmp_path / seed / f"fault-{EXPERT_DROPPED}.json")[0]
        zero = fault.route_replay.routes["zero"]
        counts = [sum(e in token[1] for seq in zero for token in seq) for e in range(8)]
        expert = counts.index(max(counts))  # the most visited in layer 1, the middle of 2
        named = (f"2 tensors with other values: layer 1; modules experts.down_proj, experts.gate_up_proj (lora_B); "
                 f"expert {expert}")
        assert [a.file_differences for a in fault.adapters if a.version == 1] == [[named]]
        fault_status = {c.id: c.status for c in fault.checks}  # in fp32, C resolves the one expert too (declared: X)
        assert fault_status["X.sync.identical"] == fault_status["C.parity.mean"] == rc.CheckStatus.FAIL
        assert any(named in line for line in findings.of_receipt(fault))


@unit
def test_both_expert_kinds_failing_is_no_swap() -> None:
    experts = findings._swap_line({"T.experts.gate_up_proj.cosine", "T.experts.down_proj.scale", "C.parity.mean"})
    assert experts is not None and experts.startswith("only the routed experts' targets fail")
    swap = findings._swap_line({"T.q_proj.cosine", "T.k_proj.scale"})
    assert swap is not None and swap.startswith("a swap: only k_proj and q_proj fail")
