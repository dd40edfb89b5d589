"""The user's vLLM engine arguments (issue 44): taken as given over lora-parity's defaults, in process and on
the `vllm serve` command line, recorded, and refused in one line where unknown, owned or unsafe."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from lora_parity.backends import engine_args
from lora_parity.backends.vllm_options import engine_options, llm_call
from lora_parity.backends.vllm_server import server_argv
from lora_parity.models import config
from lora_parity.models.config import ModelConfig
from lora_parity.run import runner
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError
from lora_parity.verdict import lifecycle

pytestmark = pytest.mark.unit


def with_args(**args: object) -> ModelConfig:
    cfg = config.load(None)
    return cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"engine_args": engine_args.check(args)})})


def test_the_users_arguments_replace_the_defaults_in_process_and_served() -> None:
    cfg = with_args(enforce_eager="false", **{"enable-prefix-caching": "true"}, max_num_seqs="8",
                    logprobs_mode="processed_logprobs")
    assert cfg.sampler.engine_args == {"enforce_eager": False, "enable_prefix_caching": True, "max_num_seqs": 8,
                                       "logprobs_mode": "processed_logprobs"}
    options = engine_options(cfg, "ckpt", cuda=False)
    assert options["enforce_eager"] is False and options["enable_prefix_caching"] is True
    assert options["max_num_seqs"] == 8 and options["logprobs_mode"] == "processed_logprobs"
    assert "max_num_seqs=8" in llm_call(options)
    default = engine_options(config.load(None), "ckpt", cuda=False)
    assert default["enforce_eager"] is True and default["enable_prefix_caching"] is False
    assert "max_num_seqs" not in default
    argv = server_argv(cfg, Path("ckpt"), 8123, cuda=False)
    assert "--enforce-eager" not in argv and "--no-enforce-eager" in argv  # never silently replaced
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv.count("--enable-prefix-caching") == 1
    plain = server_argv(config.load(None), Path("ckpt"), 8123, cuda=False)
    assert "--enforce-eager" in plain and argv[argv.index("--block-size") + 1] == "32"
    blocks = server_argv(with_args(block_size=16), Path("ckpt"), 8123, cuda=False)
    assert blocks.count("--block-size") == 1 and blocks[blocks.index("--block-size") + 1] == "16"


def test_they_are_recorded_with_what_they_change() -> None:
    cfg = with_args(enforce_eager=False)
    assert engine_args.record(cfg.sampler.engine_args) == ["enforce_eager=false"]
    assert engine_args.notes(cfg.sampler.engine_args)[0].startswith("enforce_eager=false: CUDA graphs and compilation")
    settings = {"engine_args": engine_args.record(cfg.sampler.engine_args),
                "engine_args_effect": engine_args.notes(cfg.sampler.engine_args)}
    row = next(r for r in lifecycle.derive("vllm", settings, []) if r.condition == "the user's engine arguments")
    assert row.status == "covered" and "enforce_eager=false" in row.detail and "repeats may not be exact" in row.detail


@pytest.mark.parametrize(("pair", "message"), [
    ("trust_remote_code=true", "engine argument 'trust_remote_code' is refused: runs the checkpoint's own Python "
                               "code: use --trust-remote-code"),
    ("worker_extension_cls=my.Mod", "engine argument 'worker_extension_cls' is refused: it names code or files"),
    ("load_format=pt", "engine argument 'load_format' is refused: safetensors only"),
    ("enable_lora=false", "engine argument 'enable_lora' is refused: LoRA is what lora-parity checks"),
    ("no_such_key=1", "unknown engine argument 'no_such_key'; allowed: "),
    ("max_num_seqs=many", "engine argument max_num_seqs='many': expected int"),
    ("logprobs_mode=softmax", "engine argument logprobs_mode='softmax': expected raw_logprobs or"),
    ("enforce_eager", "--engine-arg 'enforce_eager': expected KEY=VALUE"),
])
def test_unknown_owned_and_unsafe_keys_are_refused_in_one_line(pair: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        execute(RunOptions(sampler="vllm", engine_args=(pair,), out=tmp_path / "r.json"))
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert not (tmp_path / "r.json").exists()


def test_a_config_section_is_checked_too_and_the_flag_wins(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "configs" / "qwen3-0.6b-synth.yaml").read_text()
    assert "\nsampler:\n" in text
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("\nsampler:\n", "\nsampler:\n  engine_args: {seed: 3}\n", 1))
    with pytest.raises(ConfigError, match=r"^engine argument 'seed' is refused: lora-parity seeds the engine$"):
        execute(RunOptions(model=str(path), sampler="vllm", out=tmp_path / "r.json"))
    path.write_text(text.replace("\nsampler:\n", "\nsampler:\n  engine_args: {max_num_seqs: 3}\n", 1))
    cfg = config.load(str(path))
    assert cfg.sampler.engine_args == {"max_num_seqs": 3}
    merged = runner._with_engine_args(cfg, RunOptions(sampler="vllm", engine_args=("max_num_seqs=5", "block_size=16")))
    assert merged.sampler.engine_args == {"max_num_seqs": 5, "block_size": 16}  # the flag wins over the config


def test_engine_arguments_are_refused_for_samplers_without_an_engine_to_take_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine arguments are the engine's \(--sampler vllm, vllm-server or"):
        execute(RunOptions(trainer="fake", sampler="fake", engine_args=("max_num_seqs=4",), out=tmp_path / "r.json"))


def test_graphs_are_read_off_the_started_engine() -> None:
    cpu = engine_args.graphs_truth(SimpleNamespace(cudagraph_mode="CUDAGraphMode.NONE", cudagraph_capture_sizes=[],
                                                   mode="CompilationMode.NONE"), "cpu")
    assert cpu.startswith("off (vLLM-CPU captures no CUDA graphs") and "compilation mode NONE" in cpu
    import enum

    compile_mode = enum.IntEnum("CompilationMode", ["NONE", "VLLM_COMPILE"], start=0).NONE
    assert "compilation mode NONE" in engine_args.graphs_truth(SimpleNamespace(mode=compile_mode), "cpu")
    on = engine_args.graphs_truth(SimpleNamespace(cudagraph_mode="CUDAGraphMode.FULL_AND_PIECEWISE",
                                                  cudagraph_capture_sizes=[1, 2, 4, 8], mode="3"), "cuda")
    assert on == "on (cudagraph_mode FULL_AND_PIECEWISE, 4 capture sizes up to 8)"
    assert engine_args.graphs_truth(SimpleNamespace(cudagraph_mode="NONE", cudagraph_capture_sizes=[8]),
                                    "cuda").startswith("off (cudagraph_mode NONE")


def test_prefix_caching_on_makes_the_in_process_sampler_read_its_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from lora_parity.backends import vllm
    from lora_parity.backends.base import BackendOptions, CachedScoringSampler

    monkeypatch.setattr(vllm.VLLMSampler, "__init__", lambda self, *a, **k: None)
    on = with_args(enable_prefix_caching=True)
    assert isinstance(vllm.VLLMSampler.create(on, Path("ckpt"), {}, BackendOptions()), CachedScoringSampler)
    assert not isinstance(vllm.VLLMSampler.create(config.load(None), Path("ckpt"), {}, BackendOptions()),
                          CachedScoringSampler)
    merged = BackendOptions(lora=False)  # the merged modes score no adapter: nothing to read per adapter
    assert not isinstance(vllm.VLLMSampler.create(on, Path("ckpt"), {}, merged), CachedScoringSampler)
    # Blocks of 32 on the CPU, so that the probes' prefixes have full blocks to read back; the user's size wins.
    assert engine_options(on, "ckpt", cuda=False)["block_size"] == 32
    assert "block_size" not in engine_options(on, "ckpt", cuda=True)
    assert engine_options(with_args(enable_prefix_caching=True, block_size=64), "ckpt", cuda=False)["block_size"] == 64
