"""The public Python API (`lora_parity.api.check`) on a caller's own trainer, engine and sync, none of them a
lora-parity backend; and backends that installed packages register through entry points."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lora_parity import backends
from lora_parity.api import check
from lora_parity.evidence.receipt import Verdict
from lora_parity.run.runner import RunOptions, execute
from lora_parity.util.errors import ConfigError, ReceiptExistsError
from lora_parity.verdict.verify import verify

from .conftest import ROOT, cli

pytestmark = pytest.mark.unit

TOY_STACK = '''
"""A user's own tiny stack, written without lora-parity: a toy model with LoRA on two modules per layer, a
trainer copy and an engine copy of it, and a sync that copies the trainer's LoRA tensors into the engine."""

import copy
import math
import random

VOCAB, DIM, RANK, LAYERS = 32, 4, 2, 4
KINDS = ("q_proj", "v_proj")
SCALE = 2.0  # alpha / rank


def _matrix(rng, rows, cols, std):
    return [[rng.gauss(0.0, std) for _ in range(cols)] for _ in range(rows)]


def _matvec(m, x):
    return [sum(a * b for a, b in zip(row, x)) for row in m]


class ToyModel:
    """Per position: x = embed[token] + pos[t]; each layer x += tanh(Q x) * (V x); logits = U x."""

    def __init__(self, seed=0):
        rng = random.Random(seed)
        self.embed = _matrix(rng, VOCAB, DIM, 1.0)
        self.pos = _matrix(rng, 64, DIM, 0.3)
        self.weights = {(layer, kind): _matrix(rng, DIM, DIM, 0.5) for layer in range(LAYERS) for kind in KINDS}
        self.unembed = _matrix(rng, VOCAB, DIM, 1.0)

    def logprobs(self, sequences, lora):
        out = []
        for seq in sequences:
            row = []
            for t in range(len(seq) - 1):
                x = [e + p for e, p in zip(self.embed[seq[t]], self.pos[t])]
                for layer in range(LAYERS):
                    q, v = (self._project(layer, kind, x, lora) for kind in KINDS)
                    x = [xi + math.tanh(qi) * vi for xi, qi, vi in zip(x, q, v)]
                logits = _matvec(self.unembed, x)
                top = max(logits)
                row.append(logits[seq[t + 1]] - top - math.log(sum(math.exp(z - top) for z in logits)))
            out.append(row)
        return out

    def _project(self, layer, kind, x, lora):
        y = _matvec(self.weights[(layer, kind)], x)
        if lora is None:
            return y
        a = lora[f"model.layers.{layer}.self_attn.{kind}.lora_A.weight"]
        b = lora[f"model.layers.{layer}.self_attn.{kind}.lora_B.weight"]
        return [yi + SCALE * di for yi, di in zip(y, _matvec(b, _matvec(a, x)))]


class ToyTrainer:
    def __init__(self):
        self.model = ToyModel()
        rng = random.Random(1)
        self.lora = {}
        for layer in range(LAYERS):
            for kind in KINDS:
                self.lora[f"model.layers.{layer}.self_attn.{kind}.lora_A.weight"] = _matrix(rng, RANK, DIM, 0.5)
                self.lora[f"model.layers.{layer}.self_attn.{kind}.lora_B.weight"] = [[0.0] * RANK for _ in range(DIM)]

    def score(self, sequences):
        return self.model.logprobs(sequences, self.lora)

    def lora_state_dict(self):
        return copy.deepcopy(self.lora)

    def load_lora_state_dict(self, tensors):
        self.lora = copy.deepcopy(dict(tensors))


class ToyEngine:
    def __init__(self):
        self.model = ToyModel()
        self.lora = None  # serves nothing until the first sync

    def score(self, sequences):
        return self.model.logprobs(sequences, self.lora)

    def score_base(self, sequences):
        return self.model.logprobs(sequences, None)

    def lora_state_dict(self):
        return copy.deepcopy(self.lora)

    def load_lora_state_dict(self, tensors):
        self.lora = copy.deepcopy(dict(tensors))


def make_sync(trainer, engine, skip_layer=None):
    """The stack's sync; with `skip_layer`, that layer's tensors never leave the engine once it has some."""
    def sync():
        tensors = trainer.lora_state_dict()
        if skip_layer is not None and engine.lora is not None:
            for name in tensors:
                if f".layers.{skip_layer}." in name:
                    tensors[name] = engine.lora[name]
        engine.load_lora_state_dict(tensors)
    return sync
'''

_RNG = random.Random(5)
SEQUENCES = [[_RNG.randrange(32) for _ in range(n)] for n in (12, 17, 9)]  # varied tokens: attention is not uniform


@pytest.fixture
def toy(tmp_path: Path) -> ModuleType:
    """The scratch stack, imported from its own file (no lora-parity import in it)."""
    path = tmp_path / "scratch" / "toystack.py"
    path.parent.mkdir()
    path.write_text(TOY_STACK)
    assert "lora_parity" not in TOY_STACK
    spec = importlib.util.spec_from_file_location("toystack", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _counted(sync: Any) -> Any:
    def counted() -> None:
        counted.calls += 1  # type: ignore[attr-defined]
        sync()
    counted.calls = 0  # type: ignore[attr-defined]
    return counted


def test_the_callers_own_stack_passes_and_its_receipt_verifies(toy: ModuleType, tmp_path: Path) -> None:
    trainer, engine = toy.ToyTrainer(), toy.ToyEngine()
    before = trainer.lora_state_dict()
    sync = _counted(toy.make_sync(trainer, engine))
    result = check(trainer, engine, sync, SEQUENCES, alpha=4.0, out=tmp_path / "receipt.json")
    assert result.passed and result.verdict == Verdict.PASS, result.summary()
    assert result.failed_checks == [] and result.path == tmp_path / "receipt.json"
    assert verify(tmp_path / "receipt.json").verdict == Verdict.PASS
    receipt = result.receipt
    assert receipt.sync_mode == "user" and receipt.trainer.backend == receipt.sampler.backend == "api"
    assert receipt.trainer.settings["object"] == "toystack.ToyTrainer"
    assert receipt.probes.sequences == SEQUENCES and receipt.probes.source is not None
    assert receipt.probes.source.kind == "given"
    phases = [p.name for p in receipt.phases]
    for phase in ("base", "stale", "sync", "fresh", "target.q_proj", "target.v_proj", "target.q_proj@0-1"):
        assert phase in phases
    assert {c.id for c in receipt.checks} >= {"B.withheld", "C.parity.mean", "X.sync.identical", "T.v_proj.slope"}
    # Every adapter version went through the caller's sync, and one more call gave the engine its adapter back.
    assert sync.calls == len(receipt.adapters) + 1
    assert trainer.lora_state_dict() == before and engine.lora == before
    from lora_parity.cli.rerun import options_for

    with pytest.raises(ConfigError, match="went through the Python API"):  # `verify --rerun` cannot rebuild them
        options_for(receipt, lambda command, args: {})


@pytest.mark.parametrize("layer", [1, 3])
def test_a_sync_that_skips_a_layer_fails_delivery(toy: ModuleType, tmp_path: Path, layer: int) -> None:
    trainer, engine = toy.ToyTrainer(), toy.ToyEngine()
    result = check(trainer, engine, toy.make_sync(trainer, engine, skip_layer=layer), SEQUENCES, alpha=4.0,
                   out=tmp_path / "receipt.json")
    assert result.verdict == Verdict.FAIL and not result.passed
    failed = set(result.failed_checks)
    assert {"C.parity.mean", "X.sync.identical"} <= failed, result.summary()
    assert any(c.startswith("T.") for c in failed)
    assert all(c.startswith(("C.", "X.", "T.")) for c in failed), failed
    verdicts = result.receipt.verdicts
    assert verdicts.sync.verdict == Verdict.FAIL and verdicts.numerics.verdict == Verdict.PASS
    assert failed <= set(verdicts.sync.decided_by)
    assert verify(tmp_path / "receipt.json").verdict == Verdict.FAIL
    assert "X.sync.identical: fail" in result.summary()


class ScoreOnly:
    """An engine with nothing but `score`: no base-model route, no tensors to load."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def score(self, sequences: list[list[int]]) -> Any:
        return self.engine.score(sequences)


def test_an_engine_that_only_scores_skips_what_it_cannot_do_and_says_so(toy: ModuleType) -> None:
    trainer, engine = toy.ToyTrainer(), toy.ToyEngine()
    result = check(trainer, ScoreOnly(engine), toy.make_sync(trainer, engine), SEQUENCES, alpha=4.0, per_layer=False)
    phases = [p.name for p in result.receipt.phases]
    assert "base" not in phases and "fresh" not in phases and "target.q_proj" in phases
    assert result.verdict == Verdict.INCONCLUSIVE and result.failed_checks == []
    assert "no score_base" in result.summary() and "A.zero_adapter_noop: not reached" in result.summary()
    broken = check(trainer, ScoreOnly(engine), toy.make_sync(trainer, engine, skip_layer=0), SEQUENCES, alpha=4.0,
                   per_layer=False)
    assert broken.verdict == Verdict.FAIL and "C.parity.mean" in broken.failed_checks


def test_bad_input_is_refused_before_the_callers_sync_runs(toy: ModuleType, tmp_path: Path) -> None:
    trainer, engine = toy.ToyTrainer(), toy.ToyEngine()
    sync = _counted(toy.make_sync(trainer, engine))
    with pytest.raises(ConfigError, match=r"targets \['k_proj', 'q_proj'\]: the trainer's LoRA tensors are on"):
        check(trainer, engine, sync, SEQUENCES, alpha=4.0, targets=["q_proj", "k_proj"])
    with pytest.raises(ConfigError, match="rank 8: the trainer's LoRA tensors have rank 2"):
        check(trainer, engine, sync, SEQUENCES, alpha=4.0, rank=8)
    with pytest.raises(ConfigError, match=r"sequences\[1\]: a list of at least 2"):
        check(trainer, engine, sync, [[1, 2], [3]], alpha=4.0)
    (tmp_path / "taken.json").write_text("{}")
    with pytest.raises(ReceiptExistsError):
        check(trainer, engine, sync, SEQUENCES, alpha=4.0, out=tmp_path / "taken.json")
    trainer.lora["model.layers.0.self_attn.q_proj.weight"] = [[0.0]]
    with pytest.raises(ConfigError, match=r"q_proj\.weight: not a LoRA tensor's name"):
        check(trainer, engine, sync, SEQUENCES, alpha=4.0)
    del trainer.lora["model.layers.0.self_attn.q_proj.weight"]
    del trainer.lora["model.layers.0.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(ConfigError, match=r"has no partner .*q_proj\.lora_B\.weight"):
        check(trainer, engine, sync, SEQUENCES, alpha=4.0)
    with pytest.raises(ConfigError, match="engine: object has no score"):
        check(trainer, object(), sync, SEQUENCES, alpha=4.0)
    with pytest.raises(ConfigError, match="sync: NoneType is not callable"):
        check(trainer, engine, None, SEQUENCES, alpha=4.0)  # type: ignore[arg-type]
    assert sync.calls == 0 and engine.lora is None


class Array:
    """What numpy arrays and CPU torch tensors offer: `.tolist()`."""

    def __init__(self, values: Any) -> None:
        self.values = values

    def tolist(self) -> Any:
        return self.values


def test_tensors_are_read_through_tolist_and_handed_back_as_nested_floats() -> None:
    from lora_parity.api import tensors as tn

    flat = tn.to_flat("layers.2.q_proj.lora_A.weight", Array([[1, 2, 3], [4, 5, 6]]))
    assert flat.shape == (2, 3) and flat.nested() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert tn.Flat((3, 1), (1.0, 2.0, 3.0)).nested() == [[1.0], [2.0], [3.0]]
    with pytest.raises(ConfigError, match="ragged"):
        tn.to_flat("t", [[1.0, 2.0], [3.0]])
    with pytest.raises(ConfigError, match="non-finite"):
        tn.to_flat("t", Array([[float("nan")]]))
    state = {f"layers.{n}.{kind}.lora_{ab}.weight": tn.Flat((2, 3) if ab == "A" else (3, 2), (0.0,) * 6)
             for n in (5, 2) for kind in ("v_proj", "q_proj") for ab in "AB"}
    layout = tn.layout(state)
    assert (layout.targets, layout.rank, layout.layers) == (["v_proj", "q_proj"], 2, [2, 5])
    state["q_proj.lora_A"], state["q_proj.lora_B"] = tn.Flat((2, 3), (0.0,) * 6), tn.Flat((3, 2), (0.0,) * 6)
    assert tn.layout(state).layers == []  # a tensor without a layer index: no per-layer coverage
    state["q_proj.lora_A"] = tn.Flat((4, 3), (0.0,) * 12)
    with pytest.raises(ConfigError, match=r"ranks \[2, 4\]"):
        tn.layout(state)


def test_an_exception_in_the_callers_engine_ends_in_an_error_receipt(toy: ModuleType, tmp_path: Path) -> None:
    trainer, engine = toy.ToyTrainer(), toy.ToyEngine()
    before = trainer.lora_state_dict()

    class FailsAfterSync(ScoreOnly):
        calls = 0

        def score(self, sequences: list[list[int]]) -> Any:
            self.calls += 1
            if self.calls > 3:  # zero, its repeat, stale; then the engine breaks
                raise RuntimeError("engine lost")
            return super().score(sequences)

    result = check(trainer, FailsAfterSync(engine), toy.make_sync(trainer, engine), SEQUENCES, alpha=4.0,
                   out=tmp_path / "receipt.json")
    assert result.verdict == Verdict.ERROR
    error = result.receipt.error
    assert error is not None and error.startswith("phase updated: RuntimeError: engine lost"), error
    assert verify(tmp_path / "receipt.json").verdict == Verdict.ERROR
    assert trainer.lora_state_dict() == before and engine.lora == before


SCRATCH_TEST = '''
from toystack import ToyEngine, ToyTrainer, make_sync

from lora_parity.api import check

SEQUENCES = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [1, 4, 1, 4, 2]]


def test_our_sync_delivers_the_adapter(tmp_path):
    trainer, engine = ToyTrainer(), ToyEngine()
    result = check(trainer, engine, make_sync(trainer, engine), SEQUENCES, alpha=4.0, out=tmp_path / "sync.json")
    assert result.passed, result.summary()


def test_a_sync_that_skips_a_layer_is_caught():
    trainer, engine = ToyTrainer(), ToyEngine()
    result = check(trainer, engine, make_sync(trainer, engine, skip_layer=2), SEQUENCES, alpha=4.0)
    assert not result.passed and "X.sync.identical" in result.failed_checks, result.summary()
'''


def test_a_scratch_repository_tests_its_own_sync_with_pytest(tmp_path: Path) -> None:
    """The user's view: a repository of its own (its stack and a pytest file), lora-parity installed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "toystack.py").write_text(TOY_STACK)
    (repo / "test_sync.py").write_text(SCRATCH_TEST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(repo)], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr


# --- plugins: backends an installed package registers through an entry point ---

PLUGIN = '''
from lora_parity.backends.fake import FakeSampler, FakeTrainer
from lora_parity.evidence.receipt import BackendInfo


class DemoTrainer(FakeTrainer):
    def info(self):
        return BackendInfo(backend="demo", versions={}, settings={})


class DemoSampler(FakeSampler):
    def info(self):
        return BackendInfo(backend="demo", versions={}, settings={})
'''
ENTRY_POINTS = '''
[lora_parity.trainers]
demo = lp_demo_plugin:DemoTrainer
broken = lp_demo_broken:Trainer
needs-more = lp_demo_needs:Trainer

[lora_parity.samplers]
demo = lp_demo_plugin:DemoSampler
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed distribution with entry points (a `*.dist-info` folder on sys.path, as pip leaves one), and
    a registry of this test's own."""
    root = tmp_path / "site"
    info = root / "lp_demo_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lp-demo-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    (root / "lp_demo_plugin.py").write_text(PLUGIN)
    (root / "lp_demo_broken.py").write_text("raise RuntimeError('the plugin broke while it was imported')\n")
    (root / "lp_demo_needs.py").write_text("import lp_demo_missing_dependency\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(backends, "TRAINERS", dict(backends.TRAINERS))
    monkeypatch.setattr(backends, "SAMPLERS", dict(backends.SAMPLERS))
    monkeypatch.setattr(backends, "PLUGINS", {})
    for name in ("lp_demo_plugin", "lp_demo_broken", "lp_demo_needs"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return root


def test_an_installed_plugin_runs_by_name(plugin: Path, tmp_path: Path) -> None:
    assert "demo" not in backends.TRAINERS
    backends.require_known("trainer", "demo")
    assert "lp_demo_plugin" not in sys.modules  # found by name, imported only once resolved
    assert backends.PLUGINS == {"trainer:demo": "lp-demo-plugin 1.0"}
    receipt = execute(RunOptions(trainer="demo", sampler="demo", out=tmp_path / "r.json")).receipt
    assert receipt.verdict == Verdict.PASS
    assert receipt.trainer.backend == receipt.sampler.backend == "demo"
    assert verify(tmp_path / "r.json").verdict == Verdict.PASS


def test_a_plugin_that_fails_to_import_is_one_line(plugin: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        backends.resolve("trainer", "broken")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("trainer plugin 'broken' (lp-demo-plugin 1.0) failed to import lp_demo_broken:Trainer: "
                              "RuntimeError: the plugin broke while it was imported")
    with pytest.raises(ConfigError, match=r"plugin 'needs-more' .*No module named 'lp_demo_missing_dependency'"):
        backends.resolve("trainer", "needs-more")
    with pytest.raises(ConfigError, match="plugin 'broken'"):
        execute(RunOptions(trainer="broken", sampler="fake", out=tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(ConfigError, match=r"unknown sampler backend 'nope'; choose from .*demo"):
        backends.require_known("sampler", "nope")


def test_the_cli_names_a_broken_plugin_in_one_line(plugin: Path, tmp_path: Path) -> None:
    path = os.pathsep.join([str(plugin), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = cli("run", "--trainer", "broken", "--sampler", "fake", "--out", str(tmp_path / "r.json"),
            env={"PYTHONPATH": path})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "plugin 'broken' (lp-demo-plugin 1.0)" in lines[0], r.stderr
    assert not (tmp_path / "r.json").exists()
