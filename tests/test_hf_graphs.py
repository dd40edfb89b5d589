"""The HF trainer's forwards replayed from a recorded graph (issue 47): kept only once a replay equals the eager
forward bit for bit, compared until every LoRA layer was checked at a non-zero B, recorded again when the weights'
storage moves, and off for good at a difference. On the CPU a stand-in for `torch.cuda.CUDAGraph` replays the
recorded forward eagerly (faithful, or with an injected fault); the real recording runs on a GPU only."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

SEQUENCES = [[3, 17, 5, 9, 40, 2, 11], [8, 1, 22, 4]]


@pytest.fixture(scope="module")
def trainer() -> Any:
    from lora_parity.backends.hf import HFTrainer
    from lora_parity.models import config, synthetic

    cfg = config.load(None)
    return HFTrainer(cfg, synthetic.materialize(cfg), 0, {})


class _Replay:
    """A recorded forward replayed eagerly into its output tensor; `fault(logits, model)` alters what it writes."""

    def __init__(self, forward: Any, ids: Any, mask: Any, logits: Any, fault: Any, model: Any) -> None:
        self.forward, self.ids, self.mask, self.logits = forward, ids, mask, logits
        self.fault, self.model = fault, model

    def replay(self) -> None:
        self.logits.copy_(self.fault(self.forward(self.ids, self.mask), self.model))


def _graphs(trainer: Any, fault: Any = lambda logits, model: logits, raises: Exception | None = None,
            free: int = 1 << 40) -> Any:
    from lora_parity.backends import hf_graphs

    def capture(forward: Any, ids: Any, mask: Any) -> Any:
        if raises is not None:
            raise raises
        ids, mask = ids.clone(), mask.clone() if mask is not None else None
        logits = forward(ids, mask).clone()
        replay = _Replay(forward, ids, mask, logits, fault, trainer.model)
        return hf_graphs._Graph(replay, ids, mask, logits, ())

    graphs = hf_graphs.Graphs(trainer.model, torch.device("cpu"), dense=True, capture=capture,
                              free_memory=lambda device: free)
    graphs.on, graphs.why_off = True, ""  # the CPU stands in for a CUDA device here
    return graphs


def _score(trainer: Any, graphs: Any = None) -> Any:
    from lora_parity.backends.hf import score_sequences

    return score_sequences(trainer.model, SEQUENCES, trainer.device, pack=64, graphs=graphs)


def _states(trainer: Any) -> list[tuple[str, Any]]:
    """The run's kinds of trainer state, each as (name, set-up): zero-init, one target kind, every kind."""
    return [("zero", lambda: trainer.zero_b()),
            ("q_proj", lambda: (trainer.zero_b(), trainer.perturb(0.02, 1, only="q_proj"))),
            ("all", lambda: (trainer.zero_b(), trainer.perturb(0.02, 2)))]


def test_replays_equal_eager_and_start_once_every_layer_was_checked_live(trainer: Any) -> None:
    graphs = _graphs(trainer)
    seen = []
    for name, setup in _states(trainer) * 3:
        setup()
        eager = _score(trainer)
        before = dict(graphs.counts)
        assert _score(trainer, graphs) == eager, name
        seen.append((name, graphs.counts["replayed"] - before["replayed"]))
    # zero-init: eager (the shape's first forward); q_proj: recorded and compared (its layers live); every kind: the
    # rest are new, compared again; from then on every forward is a replay
    assert seen[:3] == [("zero", 0), ("q_proj", 0), ("all", 0)]
    assert all(n == 1 for _, n in seen[3:])
    assert graphs.counts["recorded"] == 1 and not graphs.eager_only
    assert graphs.describe().startswith("since the trainer loaded, 6 replayed from 1 CUDA graph(s), 3 eager")
    trainer.zero_b()


def test_a_replay_that_differs_leaves_its_shape_eager_and_the_eager_scores_stand(trainer: Any) -> None:
    graphs = _graphs(trainer, fault=lambda logits, model: logits + 1e-3)
    trainer.zero_b()
    eager = _score(trainer)
    assert _score(trainer, graphs) == eager and graphs.counts["recorded"] == 0  # a shape's first forward
    assert _score(trainer, graphs) == eager and graphs.counts["recorded"] == 1
    assert _score(trainer, graphs) == eager  # that shape eager from now on: neither recorded nor replayed again
    assert graphs.counts == {"eager": 3, "replayed": 0, "recorded": 1}
    assert "eager only: shape [2, 7], lengths [7, 4]: a replay differed from the eager forward" in graphs.describe()


def test_a_graph_wrong_only_where_b_is_live_is_caught_before_any_replay_counts(trainer: Any) -> None:
    """The fault moves the logits only where some B is non-zero (an adapter kernel the graph got wrong): equal at
    zero-init, so the graph is kept there, and caught at the first forward with a live layer."""

    def live_only(logits: Any, model: Any) -> Any:
        from lora_parity.backends import zero_lora

        live = len(zero_lora.lora_linears(model)) - len(zero_lora.zero_layers(model))
        return logits * 1.001 if live else logits

    graphs = _graphs(trainer, fault=live_only)
    trainer.zero_b()
    _score(trainer, graphs), _score(trainer, graphs)
    assert not graphs.eager_only and graphs.counts["recorded"] == 1
    trainer.perturb(0.02, 3, only="v_proj")
    eager = _score(trainer)
    assert _score(trainer, graphs) == eager
    assert graphs.eager_only and graphs.counts["replayed"] == 0
    trainer.zero_b()


def test_moved_storage_records_again(trainer: Any) -> None:
    graphs = _graphs(trainer)
    for _, setup in _states(trainer):
        setup()
        _score(trainer, graphs)
    assert graphs.counts["recorded"] == 1
    param = next(p for n, p in trainer.model.named_parameters() if "lora_B" in n)
    param.data = param.data.clone()  # a load that replaced a tensor: the graph would read the old storage
    eager = _score(trainer)
    assert _score(trainer, graphs) == eager
    assert graphs.counts["recorded"] == 2 and not graphs.eager_only
    trainer.zero_b()


def test_a_forward_that_cannot_be_recorded_runs_eager(trainer: Any) -> None:
    graphs = _graphs(trainer, raises=RuntimeError("operation not permitted when stream is capturing"))
    trainer.zero_b()
    eager = _score(trainer)
    assert all(_score(trainer, graphs) == eager for _ in range(3))
    assert graphs.counts == {"eager": 3, "replayed": 0, "recorded": 0}  # tried once (the second), not again
    assert "recording failed: RuntimeError: operation not permitted" in graphs.describe()


@pytest.mark.parametrize("short", [1, 0])
def test_a_shape_is_recorded_only_where_the_device_has_room(trainer: Any, short: int) -> None:
    from lora_parity.backends import hf_graphs
    from lora_parity.backends.hf import score_sequences

    trainer.zero_b()
    logits = hf_graphs.call(trainer.model)(torch.tensor([SEQUENCES[0]]), None)
    need = hf_graphs.ROOM * logits.numel() * logits.element_size() + hf_graphs.RESERVE
    graphs = _graphs(trainer, free=need - short)
    seqs = [SEQUENCES[0]]
    eager = score_sequences(trainer.model, seqs, trainer.device)
    assert all(score_sequences(trainer.model, seqs, trainer.device, graphs=graphs) == eager for _ in range(3))
    if short:  # one byte short: eager for good, and the receipt says why
        assert graphs.counts == {"eager": 3, "replayed": 0, "recorded": 0}
        assert "too little free device memory to record" in graphs.describe()
    else:
        assert graphs.counts["recorded"] == 1 and not graphs.eager_only


def test_free_memory_that_cannot_be_read_leaves_the_shape_eager(trainer: Any) -> None:
    from lora_parity.backends import hf_graphs
    from lora_parity.backends.hf import score_sequences

    def unreadable(device: Any) -> int:
        raise RuntimeError("CUDA driver error: unknown")

    graphs = hf_graphs.Graphs(trainer.model, torch.device("cpu"), dense=True, capture=lambda *a: None,
                              free_memory=unreadable)
    graphs.on = True
    trainer.zero_b()
    seqs = [SEQUENCES[0]]
    eager = score_sequences(trainer.model, seqs, trainer.device)
    assert all(score_sequences(trainer.model, seqs, trainer.device, graphs=graphs) == eager for _ in range(3))
    assert "recording failed: RuntimeError: CUDA driver error: unknown" in graphs.describe()


def test_past_max_graphs_a_new_shape_runs_eager(trainer: Any) -> None:
    from lora_parity.backends import hf_graphs
    from lora_parity.backends.hf import score_sequences

    graphs = _graphs(trainer)
    trainer.zero_b()
    for n in [*range(hf_graphs.MAX_GRAPHS + 2)] * 2:
        seqs = [SEQUENCES[0][:3 + n]]
        assert score_sequences(trainer.model, seqs, trainer.device, graphs=graphs) == score_sequences(
            trainer.model, seqs, trainer.device)
    assert graphs.counts["recorded"] == hf_graphs.MAX_GRAPHS and not graphs.eager_only


@pytest.mark.parametrize(("device", "dense", "env", "why"), [
    ("cpu", True, "1", "not a CUDA device"), ("cuda", False, "1", "an MoE"),
    ("cuda", True, "0", "turned off: LORA_PARITY_TRAINER_GRAPHS=0")])
def test_where_graphs_are_off(trainer: Any, monkeypatch: Any, device: str, dense: bool, env: str | None,
                              why: str) -> None:
    from lora_parity.backends import hf_graphs

    if env is not None:
        monkeypatch.setenv(hf_graphs.ENV, env)
    else:
        monkeypatch.delenv(hf_graphs.ENV, raising=False)
    graphs = hf_graphs.Graphs(trainer.model, torch.device(device), dense=dense)
    assert not graphs.on and why in graphs.describe()


@pytest.mark.parametrize("env", [None, "1"])
def test_on_by_default_on_a_dense_model_on_a_cuda_device(trainer: Any, monkeypatch: Any, env: str | None) -> None:
    from lora_parity.backends import hf_graphs

    if env is not None:
        monkeypatch.setenv(hf_graphs.ENV, env)
    else:
        monkeypatch.delenv(hf_graphs.ENV, raising=False)
    assert hf_graphs.Graphs(trainer.model, torch.device("cuda"), dense=True).on


def test_the_cpu_trainer_runs_eager_and_its_receipt_settings_stay_as_they_were(trainer: Any) -> None:
    trainer.zero_b()
    trainer.score(SEQUENCES)
    assert not trainer.graphs.on and trainer.graphs.counts["replayed"] == 0
    assert trainer.settled_settings() == {}


def test_a_settling_trainer_s_settings_reach_the_receipt_as_they_stand_at_the_end() -> None:
    from lora_parity.backends import served
    from lora_parity.evidence.receipt import BackendInfo

    class Trainer:
        def settled_settings(self) -> dict[str, str]:
            return {"forward_graphs": "12 replayed from 1 CUDA graph(s), 3 eager"}

    info = BackendInfo(backend="hf", versions={}, settings={"dtype": "bfloat16"})
    assert served.settled(Trainer(), info).settings == {
        "dtype": "bfloat16", "forward_graphs": "12 replayed from 1 CUDA graph(s), 3 eager"}
    assert served.settled(object(), info) is info


def test_the_same_shape_with_another_padding_gets_its_own_graph(trainer: Any) -> None:
    """Two sequences padded to 7 tokens, and two of 7 (no padding): the same ids' shape, another mask, which an eager
    forward may take another path for; each is recorded and checked on its own."""
    from lora_parity.backends.hf import score_sequences

    graphs = _graphs(trainer)
    trainer.zero_b()
    trainer.perturb(0.02, 4)
    unpadded = [SEQUENCES[0], SEQUENCES[0][::-1]]
    for seqs in (SEQUENCES, unpadded) * 3:
        assert score_sequences(trainer.model, seqs, trainer.device, pack=64, graphs=graphs) == score_sequences(
            trainer.model, seqs, trainer.device, pack=64)
    assert graphs.counts == {"eager": 4, "replayed": 2, "recorded": 2}
    trainer.zero_b()
