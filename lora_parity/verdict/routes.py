"""Route replay's record, pure (docs/moe.md): how many routes an engine pass changed from the zero pass's
(`changes`), how many tokens the two sides route apart (`flipped_tokens`), the lines a run prints about them
(`lines`), and the shape `verify` requires of the recorded routes (`problem`).

The route changes are a finding, not a check: where the routers are not LoRA targets the stale pass serves the
zero adapter and must route as the zero pass did (a leak moves its scores too, which B.withheld judges), while an
update of the attention moves the routers' input, so the updated and per-target passes may route some tokens
otherwise: the run names every change and where it is, and the checks judge the scores of the replayed forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lora_parity.verdict import stats

TokenRoutes = Sequence[Sequence[Sequence[int]]]
"""[token][MoE layer] -> expert ids."""
ZERO = "zero"
SEARCH_KEY = "trainer_updated_zero_routes"
"""With route replay, the update's search (std auto, a step's learning rate) measures the trainer's change with
the zero pass's routes, before the engine's updated pass exists: the updated trainer is also scored that way under
this key, so that `verify` re-derives the search's chosen change from scores (`calibrate.check_perturbation`)."""
TARGET_SEARCH_SUFFIX = ".trainer_zero_routes"
"""The same for a per-target point's search: `target.K` + this."""
OWN_ROUTES = "trainer_zero_own_routes"
"""With route replay, the trainer at the start point also scored with its own routers' choice: A's difference both
ways on the same tokens, so each replayed run says how much of A the routing flips were (`replay_share`)."""
SCORE_KEYS = (SEARCH_KEY, OWN_ROUTES)


def changes(routes: Mapping[str, Sequence[TokenRoutes]]) -> dict[str, int]:
    """Each pass other than zero -> its (sequence, token, layer) triples routed to another expert set than the zero
    pass's; empty without a zero pass."""
    zero = routes.get(ZERO)
    if zero is None:
        return {}
    return {key: _apart(zero, other) for key, other in routes.items() if key != ZERO}


def _apart(a: Sequence[TokenRoutes], b: Sequence[TokenRoutes]) -> int:
    return sum(sorted(x) != sorted(y) for sa, sb in zip(a, b, strict=True) for ta, tb in zip(sa, sb, strict=True)
               for x, y in zip(ta, tb, strict=True))


def flipped_tokens(a: Sequence[TokenRoutes], b: Sequence[TokenRoutes]) -> int:
    """Tokens routed to another expert set in at least one layer by `a` than by `b`."""
    return sum(any(sorted(x) != sorted(y) for x, y in zip(ta, tb, strict=True))
               for sa, sb in zip(a, b, strict=True) for ta, tb in zip(sa, sb, strict=True))


def _pairs(routes: Sequence[TokenRoutes]) -> int:
    return sum(len(token) for seq in routes for token in seq)


def replay_share(scores: Mapping[str, Sequence[Sequence[float]]]) -> tuple[float, float] | None:
    """A's mean |trainer - engine| at the start point with the engine's routes replayed and with the trainer's own
    (`OWN_ROUTES`); None where the run did not score both."""
    if not all(k in scores for k in (ZERO, "trainer_zero", OWN_ROUTES)):
        return None

    def mean(trainer: str) -> float:
        diff = stats.differences(scores[ZERO], scores[trainer])
        return math.fsum(abs(d) for d in diff) / len(diff) if diff else 0.0

    return mean("trainer_zero"), mean(OWN_ROUTES)


def lines(replay: Any, router: Any, scores: Mapping[str, Sequence[Sequence[float]]] | None = None) -> list[str]:
    """What a run says about routing on an MoE model: with replay off or not available, how many tokens the two
    sides route apart and that their difference is in A; with replay, how much of A the replay removed
    (`replay_share`) and each engine pass that routed otherwise than the zero pass. Nothing for a dense model
    (`replay` None)."""
    if replay is None:
        return []
    if replay.status != "replayed":
        why = f"route replay {replay.status.replace('_', ' ')} ({replay.reason})"
        flipped = getattr(router, "flipped_tokens", None)
        if flipped is None:
            return [f"{why}: the routing flips between the two sides are not counted here; whatever they are, their "
                    "difference is in A and C"]
        return [f"{why}: {flipped} of {router.num_tokens} tokens are routed to other experts by the trainer than by "
                f"the sampler at the start point (router agreement {router.agreement:.4g}); their difference is in A "
                "and C"]
    out = []
    share = replay_share(scores or {})
    if share is not None:
        replayed, own = share
        removed = f"replay removed {1 - replayed / own:.0%} of it" if own > 0 else "nothing to remove"
        out.append(f"A at the start point with the engine's routes replayed: mean {replayed:.3g}; with the trainer's "
                   f"own routes: {own:.3g} ({removed}; what is left is the two sides' computation, not routing)")
    for key, n in sorted(replay.changes.items()):
        if n:
            total = _pairs(replay.routes[key])
            cause = ("it serves the zero adapter: the engine routed the same tokens otherwise" if key == "stale" else
                     "the update moves the routers' input; the trainer replayed these routes there")
            out.append(f"the engine's {key} pass routed {n} of {total} token-layer pairs to other experts than its "
                       f"zero pass ({cause})")
    return out


def _shape(routes: Sequence[TokenRoutes]) -> tuple[int, int]:
    """(MoE layers, top-k) of the first token's routes; (0, 0) for none."""
    first = next((token for seq in routes for token in seq), None)
    return (len(first), len(first[0]) if first else 0) if first is not None else (0, 0)


def _holds(token: Sequence[Sequence[int]], shape: tuple[int, int]) -> bool:
    """A token's routes: one set of `shape[1]` distinct expert ids (non-negative) per each of `shape[0]` layers."""
    return shape[1] > 0 and len(token) == shape[0] and all(
        len(e) == shape[1] and len(set(e)) == len(e) and min(e) >= 0 for e in token)


def problem(replay: Any, sequences: Sequence[Sequence[int]]) -> str | None:
    """What is wrong with a recorded route replay (`RouteReplay`), or None: every pass's routes cover the probes
    token for token, one top-k of distinct experts per layer, the same shape in every pass; every source a
    recorded pass; `changes` what the routes give; a replay that did not happen records no routes."""
    if replay.status != "replayed":
        return None if not (replay.routes or replay.sources or replay.changes) else "routes recorded without replay"
    shape = _shape(next(iter(replay.routes.values()), []))
    for key, routes in replay.routes.items():
        if len(routes) != len(sequences) or any(len(r) != len(s) for r, s in zip(routes, sequences, strict=False)):
            return f"routes of {key} do not cover the probe tokens"
        if not all(_holds(token, shape) for seq in routes for token in seq):
            return f"routes of {key}: each token needs one top-{shape[1]} of distinct experts per MoE layer"
    missing = sorted(set(replay.sources.values()) - set(replay.routes))
    if missing:
        return f"sources name engine passes without routes: {', '.join(missing[:3])}"
    if replay.changes != changes(replay.routes):
        return "changes do not reproduce from the routes"
    return None
