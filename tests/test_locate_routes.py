"""`lora-parity locate` on MoE models, without an engine: the flips and margins of router scores (pure, on
synthetic scores with hand-computed expectations), which layer's flips are listed, the result's optional `moe`
field and its rendering (escaped)."""

from __future__ import annotations

import pytest

from lora_parity.evidence.locate_models import Divergence, LocateResult
from lora_parity.verdict import locate_routes as lr

pytestmark = pytest.mark.unit

# Reference scores of 4 experts, top-2, per token:
#   token 0: 0.40 0.30 0.29 0.01  -> {0, 1}, margin 0.01 (near a tie)
#   token 1: 0.50 0.40 0.05 0.05  -> {0, 1}, margin 0.35 (a wide gap)
#   token 2: 0.10 0.20 0.30 0.40  -> {2, 3}, margin 0.10
REFERENCE = [[[0.40, 0.30, 0.29, 0.01], [0.50, 0.40, 0.05, 0.05], [0.10, 0.20, 0.30, 0.40]]]


def _moved(scores: list[list[list[float]]], by: dict[tuple[int, int], list[float]], noise: float) -> list:
    """`scores` + `noise` on every expert of every token, + `by[(s, t)]` on the named tokens."""
    out = []
    for s, seq in enumerate(scores):
        rows = []
        for t, row in enumerate(seq):
            extra = by.get((s, t), [0.0] * len(row))
            rows.append([x + noise * (1 if e % 2 else -1) + d for e, (x, d) in enumerate(zip(row, extra, strict=True))])
        out.append(rows)
    return out


def test_top_set_and_margin_by_hand() -> None:
    assert lr.top_set([0.1, 0.4, 0.3, 0.4], 2) == [1, 3]
    assert lr.top_set([0.2, 0.2, 0.1], 1) == [0]  # a tie goes to the lower index
    assert lr.margin([0.40, 0.30, 0.29, 0.01], 2) == pytest.approx(0.01)
    assert lr.margin([0.1, 0.2], 1) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        lr.margin([0.1, 0.2], 2)
    assert lr.deviation([0.1, 0.5], [0.2, 0.45]) == pytest.approx(0.1)


def test_a_near_tie_flip_reads_as_precision_and_a_wide_gap_as_a_divergence() -> None:
    # The trainer: 0.004 of noise on every score (no flip). The engine: the same noise, token 0's expert 2 up by
    # 0.02 (crosses a 0.01 margin: a near tie), token 1's expert 2 up by 0.5 (crosses 0.35: a wide gap).
    trainer = _moved(REFERENCE, {}, 0.004)
    engine = _moved(REFERENCE, {(0, 0): [0, 0, 0.02, 0], (0, 1): [0, 0, 0.5, 0]}, 0.004)
    layer, flips = lr.judge_layer(lr.LayerScores(3, 2, REFERENCE, trainer, engine), [7], [[0.2, 0.9]], 2.0)
    assert (layer.layer, layer.num_tokens, layer.apart, layer.trainer_flips, layer.engine_flips) == (3, 3, 2, 0, 2)
    assert layer.margin_min == pytest.approx(0.01) and layer.margin_median == pytest.approx(0.10)
    # The nearer side is the trainer (every token 0.004 off): the tie band is 2 x 0.004.
    assert layer.witness == "trainer" and layer.tie_band == pytest.approx(0.008)
    assert layer.trainer_deviation == pytest.approx(0.004) and layer.engine_deviation > 0.4
    assert [(f.sequence, f.position) for f in flips] == [(7, 0), (7, 1)]
    tie, wide = flips
    assert tie.reference == [0, 1] and tie.trainer == [0, 1] and tie.engine == [0, 2]
    assert tie.margin == pytest.approx(0.01) and tie.engine_deviation == pytest.approx(0.016)
    # 0.01 > 0.008: outside the band measured by the trainer's noise; widen the noise and it is a near tie.
    assert not tie.near_tie and not wide.near_tie
    assert tie.a_diff == pytest.approx(0.2) and wide.a_diff == pytest.approx(0.9)
    noisy = _moved(REFERENCE, {}, 0.006)
    _, again = lr.judge_layer(lr.LayerScores(3, 2, REFERENCE, noisy, engine), [7], [[0.2, 0.9]], 2.0)
    assert [f.near_tie for f in again] == [True, False]


def test_the_fp64_witness_sets_the_band_where_the_trainer_is_the_reference() -> None:
    # fp32: the trainer is the reference bit for bit (deviation 0); fp64 moves every score by 1e-3, the engine
    # flips token 0 (margin 0.01) by 0.02: a departure beyond what fp32 explains (band 2e-3).
    fp64 = _moved(REFERENCE, {}, 1e-3)
    engine = _moved(REFERENCE, {(0, 0): [0, 0, 0.02, 0]}, 1e-3)
    layer, flips = lr.judge_layer(lr.LayerScores(0, 2, REFERENCE, REFERENCE, engine, fp64), [0], [[0.0, 0.0]], 2.0)
    assert layer.witness == "fp32 vs fp64" and layer.tie_band == pytest.approx(2e-3)
    assert layer.fp64_deviation == pytest.approx(1e-3) and layer.trainer_deviation == 0.0
    assert (layer.apart, layer.trainer_flips, layer.engine_flips) == (1, 0, 1)
    assert [(f.position, f.near_tie, f.a_diff) for f in flips] == [(0, False, 0.0)]


def _layers(flip_in: set[int]) -> list[lr.LayerScores]:
    """MoE layers 1, 3 and 5; the engine flips token 0 (near a tie) in those of `flip_in`."""
    out = []
    for layer in (1, 3, 5):
        engine = _moved(REFERENCE, {(0, 0): [0, 0, 0.02, 0]} if layer in flip_in else {}, 0.0)
        out.append(lr.LayerScores(layer, 2, REFERENCE, REFERENCE, engine))
    return out


def test_the_listed_layer_is_the_named_one_or_the_first_with_a_flip() -> None:
    a = [[0.5, 0.1]]
    named = lr.routing(_layers({3, 5}), [0], a, named_layer=2, ranking="softmax", balance=2.0)
    assert named.listed_layer == 3 and "after layer 2" in named.listed_because and named.num_flips == 1
    at = lr.routing(_layers({5}), [0], a, named_layer=5, ranking="softmax", balance=2.0)
    assert at.listed_layer == 5 and at.listed_because == "locate names layer 5"
    first = lr.routing(_layers({3, 5}), [0], a, named_layer=None, ranking="softmax", balance=2.0)
    assert first.listed_layer == 3 and "first MoE layer with a flip" in first.listed_because
    assert [(f.position, f.engine) for f in first.flips] == [(0, [0, 2])]
    # Named at a layer with no flip there: that layer is still the one listed (zero flips at it).
    quiet = lr.routing(_layers({5}), [0], a, named_layer=1, ranking="softmax", balance=2.0)
    assert quiet.listed_layer == 1 and quiet.flips == [] and quiet.num_flips == 0
    none = lr.routing(_layers(set()), [0], a, named_layer=None, ranking="softmax", balance=2.0)
    assert none.listed_layer is None and none.flips == [] and [x.apart for x in none.layers] == [0, 0, 0]


def test_flips_are_listed_worst_a_token_first_and_capped() -> None:
    n = lr.MAX_FLIPS + 3
    reference = [[[0.40, 0.30, 0.29, 0.01]] * n]
    engine = [[[0.40, 0.30, 0.31, 0.01]] * n]  # every token flips {0, 1} -> {0, 2}
    a = [[float(t) for t in range(n - 1)]]  # the last token scores nothing
    moe = lr.routing([lr.LayerScores(0, 2, reference, reference, engine)], [4], a, None, "softmax", 2.0)
    assert moe.num_flips == n and len(moe.flips) == lr.MAX_FLIPS
    assert [f.position for f in moe.flips[:3]] == [n - 2, n - 3, n - 4]
    assert all(f.a_diff is not None for f in moe.flips)


def test_the_result_takes_the_routing_and_older_results_still_validate() -> None:
    from lora_parity.report.locate import markdown, moe_lines

    from .test_locate import _result

    old = _result()
    assert "moe" not in old or old["moe"] is None
    LocateResult.model_validate({k: v for k, v in old.items() if k not in ("moe", "moe_unavailable")})
    engine = _moved(REFERENCE, {(0, 1): [0, 0, 0.5, 0]}, 0.004)
    moe = lr.routing([lr.LayerScores(2, 2, REFERENCE, _moved(REFERENCE, {}, 0.004), engine)], [0], [[0.1, 3.0]],
                     named_layer=2, ranking="soft<b>max|", balance=2.0)
    result = LocateResult.model_validate({**old, "moe": moe.model_dump(mode="json")})
    assert result.moe is not None and result.moe.flips[0].a_diff == pytest.approx(3.0)
    text = markdown(result, "r.json")
    assert "#### Routing (MoE)" in text and "wide gap" in text and "<b>" not in text and "soft&lt;b>max\\|" in text
    lines = moe_lines(result)
    assert lines[0].startswith("routing: 1 token-layer pair(s) routed apart") and "locate names layer 2" in lines[0]
    assert any("flip at layer 2: seq 0 pos 1" in line for line in lines)
    unavailable = LocateResult.model_validate({**old, "moe_unavailable": "no gates"})
    assert moe_lines(unavailable) == ["MoE routing not compared: no gates"]


def test_the_named_layer_for_routing_is_the_earliest_divergence() -> None:
    from lora_parity.run.locate_moe import named_layer

    def div(point: str, layer: int | None) -> Divergence:
        return Divergence(side="engine", point=point, layer=layer, module="m", statistic="median", observed=1.0,
                          threshold=0.5)

    assert named_layer([div("layers.3", 3), div("layers.1.self_attn", 1)]) == 1
    assert named_layer([div("embed", None)]) == 0
    assert named_layer([div("norm", None)]) is None and named_layer([]) is None


def test_near_ties_are_the_tokens_flipped_within_the_band_at_their_first_moe_layer() -> None:
    noisy = _moved(REFERENCE, {}, 0.006)
    engine = _moved(REFERENCE, {(0, 0): [0, 0, 0.02, 0], (0, 1): [0, 0, 0.5, 0]}, 0.004)
    layers = [lr.LayerScores(3, 2, REFERENCE, noisy, engine), lr.LayerScores(5, 2, REFERENCE, noisy, engine)]
    assert lr.near_ties(layers, 2.0) == {(0, 0): 3}  # the wide gap at token 1 is a divergence, never left out
    assert lr.near_ties(layers[1:], 2.0) == {(0, 0): 5}
    assert lr.near_ties([lr.LayerScores(3, 2, REFERENCE, noisy, noisy)], 2.0) == {}
