"""Strangers, round two (issue 46, cases 2, 5, 6, 7, 8, 16): a pasted key with a newline is refused before it is
sent anywhere, no output replaces a device, a FIFO or a link, YAML aliases and duplicate keys are refused before
anything expands, an adapter's r is checked against its tensors before a model is built at that rank, and a probe
file is split at newlines only."""

import json
import os
import time
from pathlib import Path

import pytest

from lora_parity.backends import served
from lora_parity.backends.base import PreflightOptions
from lora_parity.evidence import signing
from lora_parity.models import config
from lora_parity.report import files
from lora_parity.run import probes, start_adapter
from lora_parity.util import safe_write
from lora_parity.util.errors import ConfigError

pytestmark = pytest.mark.unit


def test_a_key_with_a_trailing_newline_is_refused_without_being_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LP_TEST_KEY", "sk-secret-123456\n")
    with pytest.raises(ConfigError, match="whitespace or control characters") as e:
        served.check_options(PreflightOptions(trainer="fake", sampler="sglang", api_key_env="LP_TEST_KEY"))
    assert "sk-secret" not in str(e.value)
    monkeypatch.setenv("LP_TEST_KEY", "sk-secret-123456")
    served.check_options(PreflightOptions(trainer="fake", sampler="sglang", api_key_env="LP_TEST_KEY"))  # clean


def test_no_output_replaces_a_fifo_or_writes_through_a_link(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        safe_write.write_atomic(fifo, "x")
    assert fifo.is_fifo()
    target = tmp_path / "precious"
    target.write_text("keep")
    link = tmp_path / "report.md"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        files.write_atomic(link, "overwritten")
    assert target.read_text() == "keep" and link.is_symlink()
    # keygen --force onto a FIFO: refused at once (no hang), no half keypair
    started = time.monotonic()
    with pytest.raises(ConfigError, match="not a regular file"):
        signing.keygen(fifo, force=True)
    assert time.monotonic() - started < 5 and fifo.is_fifo() and not (tmp_path / "fifo.pub").exists()
    # a regular file is replaced atomically, leaving no temporary behind, with the umask's mode
    plain = tmp_path / "out.txt"
    plain.write_text("old")
    safe_write.write_atomic(plain, "new")
    assert plain.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    private, public = signing.keygen(tmp_path / "k")
    assert private.stat().st_mode & 0o777 == 0o600 and public.exists()


def test_yaml_aliases_and_duplicate_keys_are_refused_before_anything_expands(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    bomb = tmp_path / "lol.yaml"
    bomb.write_text("\n".join(lines) + "\nmodel: {name: lol, layers: *a9}\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"malformed YAML at line 2: aliases \(\*name\) are refused"):
        config.load(str(bomb))
    assert time.monotonic() - started < 2
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: a\nname: b\n")
    with pytest.raises(ConfigError, match="duplicate key 'name'"):
        config.load(str(dup))


def test_an_adapters_rank_is_checked_against_its_tensors_before_a_model_is_built(tmp_path: Path) -> None:
    from lora_parity.models import adapter_files as af

    folder = tmp_path / "ad"
    a = af.Tensor.from_floats("F32", [4, 8], [0.0] * 32)
    b = af.Tensor.from_floats("F32", [8, 4], [0.0] * 32)
    af.write_adapter(folder, {"r": 150000, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"},
                     {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
                      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b})
    with pytest.raises(ConfigError, match=r"says r = 150000, but its tensor .*q_proj.lora_A.weight has shape \[4, 8\]"):
        start_adapter.apply(config.load("tiny-qwen3"), folder, model_shapes=False)
    assert start_adapter.rank_problem({"x.lora_A.weight": {"shape": [4, 8]}, "x.lora_B.weight": {"shape": [8, 4]}},
                                      4) is None


def test_a_probe_file_is_split_at_newlines_only_and_refuses_duplicate_keys() -> None:
    text = json.dumps({"text": "one\u2028two\x1cthree"}) + "\r\n" + json.dumps({"tokens": [1, 2, 3]}) + "\n"
    seqs = probes.parse_jsonl(text, 100, 16, 8, lambda: (lambda t: [5, 6, 7]))
    assert seqs == [[5, 6, 7], [1, 2, 3]]
    with pytest.raises(ConfigError, match="line 1: duplicate key 'tokens'"):
        probes.parse_jsonl('{"tokens": [1, 2], "tokens": [3, 4]}\n', 100, 16, 8, lambda: None)



def test_a_huge_finite_score_is_refused_in_one_line_and_never_hides_the_other_receipts(tmp_path: Path) -> None:
    """Case 13: -1.7e308 overflowed every statistic; now it is not a logprob, named, and a multi-file
    `verify --json` still reports every receipt."""
    import subprocess
    import sys

    from lora_parity.evidence.receipt import compute_digest

    good = Path(__file__).resolve().parents[1] / "receipts" / "tiny-qwen3__hf__vllm__20261130T134155Z.json"
    data = json.loads(good.read_text())
    data["scores"]["updated"][0][1] = -1.7e308
    data["digest"] = compute_digest(data)
    bad = tmp_path / "huge.json"
    bad.write_text(json.dumps(data))
    res = subprocess.run([sys.executable, "-m", "lora_parity", "verify", str(bad)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "not a logprob (below -1e+06)" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, "-m", "lora_parity", "verify", "--json", str(bad), str(good)],
                         capture_output=True, text=True, timeout=120)
    results = json.loads(res.stdout)
    assert res.returncode == 2 and [r["intact"] for r in results] == [False, True], res.stdout


def test_a_receipts_version_keys_and_bare_urls_render_as_text() -> None:
    """Case 12: a version key cannot make the report bold (`**Verdict: PASS**`), and a bare https:// or www.
    string in a receipt is not a link GitHub would make."""
    from lora_parity.report.pr import _versions
    from lora_parity.util.escape import markdown, markdown_markup

    rendered = markdown_markup(f"trainer `hf`: {_versions({'**Verdict: PASS**': '1', 'vllm': '0.26'})}")
    assert "**Verdict" not in rendered.replace("`**Verdict: PASS**`", "")
    assert "`**Verdict: PASS**` `1`" in rendered
    text = markdown("from https://evil.example/x and www.evil.example")
    assert "https://" not in text and "www." not in text and "evil.example" in text


def test_bad_inputs_are_refused_before_anything_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 14: a seed above int64, `LORA_PARITY_CACHE` naming a file, a checkpoint whose safetensors header is
    malformed: one line, exit 2, within seconds, no receipt."""
    import subprocess
    import sys

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lora_parity", "run", "--trainer", "fake", "--sampler", "fake",
                               "--out", str(tmp_path / "r.json"), *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, **(env or {})})

    res = run("--seed", str(2**64))
    assert res.returncode == 2 and "--seed must be in [0, 2**63)" in res.stderr
    afile = tmp_path / "cache-file"
    afile.write_text("x")
    res = run(env={"LORA_PARITY_CACHE": str(afile)})
    assert res.returncode == 2 and "LORA_PARITY_CACHE" in res.stderr and "not a folder" in res.stderr
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{not json")
    res = run("--model", str(ck))
    assert res.returncode == 2 and "model.safetensors: not a readable safetensors file" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "r.json").exists()


def test_an_odd_terminal_or_summary_file_never_loses_a_passing_run(tmp_path: Path) -> None:
    """Case 15: a non-UTF-8 stdout and COLUMNS=0 still print the result and exit 0; GITHUB_STEP_SUMMARY naming a
    FIFO is refused in one line instead of blocking the job."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "0"}
    res = subprocess.run([sys.executable, "-m", "lora_parity", "run", "--trainer", "fake", "--sampler", "fake",
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0 and "pass:" in res.stdout and "Traceback" not in res.stderr, res.stderr[-400:]
    fifo = tmp_path / "summary"
    os.mkfifo(fifo)
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(fifo)}
    res = subprocess.run([sys.executable, "-m", "lora_parity", "report", str(tmp_path / "r.json"),
                          "--github-summary"], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2 and "GITHUB_STEP_SUMMARY" in res.stderr and fifo.is_fifo()


@pytest.mark.parametrize("args, env, says", [
    (["run", "--sampler", "vllm-server"], {"LORA_PARITY_VLLM_SERVER_START_TIMEOUT": "abc"},
     "LORA_PARITY_VLLM_SERVER_START_TIMEOUT='abc': not a positive number of seconds"),
    (["run", "--sampler", "fake"], {"LORA_PARITY_CONFIGS": "FILE"}, "LORA_PARITY_CONFIGS="),
    (["selftest", "--sampler", "fake", "--out-dir", "FILE"], {}, "--out-dir"),
    (["run", "--sampler", "fake", "--probes", "DEEP"], {}, "line 1: nested too deeply to be a probe"),
])
def test_odd_inputs_get_a_line_that_names_them_not_unexpected(args: list[str], env: dict[str, str], says: str,
                                                              tmp_path: Path) -> None:
    """Case 17: each of these reached "unexpected X"; now one line naming the input, exit 2."""
    import subprocess
    import sys

    afile = tmp_path / "afile"
    afile.write_text("x")
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"tokens": ' + "[" * 100000 + "]" * 100000 + "}\n")
    swap = {"FILE": str(afile), "DEEP": str(deep)}
    argv = [swap.get(a, a) for a in args]
    res = subprocess.run([sys.executable, "-m", "lora_parity", *argv, "--trainer", "fake"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, **{k: swap.get(v, v) for k, v in env.items()}})
    assert res.returncode == 2 and says in res.stderr and "unexpected" not in res.stderr, res.stderr[-300:]


def test_a_config_json_of_huge_dimensions_beside_small_weights_is_refused_at_preflight(tmp_path: Path) -> None:
    """Case 7: config.json's sizes are checked against the weights' headers before any model is built."""
    import shutil

    from lora_parity.models import checkpoint, synthetic

    ck = tmp_path / "ck"
    shutil.copytree(synthetic.materialize(config.load("tiny-qwen3")), ck)
    assert checkpoint._weights_problem(ck) is None
    hf = json.loads((ck / "config.json").read_text())
    for field, value, says in (("hidden_size", 2**20, "hidden_size 1048576, but the embedding weights are"),
                               ("num_hidden_layers", 4096, "num_hidden_layers 4096, but the weights hold")):
        (ck / "config.json").write_text(json.dumps({**hf, field: value}))
        with pytest.raises(ConfigError, match=says):
            checkpoint.require_safetensors(config.load(str(ck)))


def test_the_plan_states_what_a_one_process_run_holds(tmp_path: Path) -> None:
    """Case 7: `--plan` gives a memory estimate, from the checkpoint's safetensors headers (nothing loaded)."""
    from lora_parity.models import synthetic
    from lora_parity.run import plan

    cfg = config.load("tiny-qwen3")
    folder = synthetic.materialize(cfg)
    gib = plan.checkpoint_gib(folder)
    on_disk = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 2**30
    assert 0.9 * on_disk < gib <= on_disk
    assert f"memory: base weights {gib:.3g} GiB (float32)" in plan.render(cfg)


def test_report_out_never_writes_through_a_link_planted_at_a_plot_path(tmp_path: Path) -> None:
    """Case 8: a symbolic link at one of the plot paths is refused, its target untouched; no temporary is left."""
    import subprocess
    import sys

    receipt = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "lora_parity", "run", "--trainer", "fake", "--sampler", "fake",
                          "--quiet", "--out", str(receipt)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "rep"
    out.mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep")
    (out / "A.trainer_vs_sampler.png").symlink_to(precious)
    res = subprocess.run([sys.executable, "-m", "lora_parity", "report", str(receipt), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "symbolic link" in res.stderr and precious.read_text() == "keep", res.stderr
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
