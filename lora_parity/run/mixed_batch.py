"""The mixed batch (issue 44; docs/deployment.md, "Mixed batches"): after the sync, the engine scores the probes
under its base model and the synced adapter (and the version the sync replaced, where one batch serves two
adapters) in one batch, requests interleaved, as a deployed engine serves rollouts of several routes at once. Each
route must score as it did alone (`verdict.mixed_batch`, checks M.*). The same batch all under the synced adapter
(`mixed_control`) measures what the batch's size and order alone move, the noise the checks allow beside the
sampler's repeat noise."""

from __future__ import annotations

from typing import Any

from lora_parity.backends.base import AdapterHandle
from lora_parity.backends.mixed_batch import MixedBatchSampler

ROUTE_KEYS = {"base": "mixed_base", "updated": "mixed_updated", "old": "mixed_old"}
"""Route -> the scores key of its requests in the mixed batch."""
CONTROL_KEY = "mixed_control"


def routes(run: Any) -> dict[str, AdapterHandle | None]:
    """The routes the mixed batch serves: the base model (where the sampler serves it), the synced adapter, and the
    replaced version where the sync kept it and one batch serves two adapters (`adapters_per_batch`)."""
    sampler = run.sampler
    if sampler.traits.mixed_batch_unavailable is not None or not isinstance(sampler, MixedBatchSampler) \
            or run.handle is None or not run.mode.sampler_lora:
        return {}
    out: dict[str, AdapterHandle | None] = {}
    if run.sampler_scores_base:
        out["base"] = None
    out["updated"] = run.handle
    if run.kept is not None and sampler.adapters_per_batch >= 2:
        out["old"] = run.faults.old_handle(run.kept, run.handle)
    return out if len(out) >= 2 else {}


def applies(run: Any) -> bool:
    """A sampler that mixes routes in one batch, and at least two routes to mix."""
    return bool(routes(run))


def score(run: Any) -> None:
    """The mixed batch, then the control batch of the same size and order all under the synced adapter."""
    named = routes(run)
    sampler = run.sampler
    mixed = run.faults.mixed_scores(run._timed("mixed_batch", lambda: sampler.score_mixed(run.sequences,
                                                                                           list(named.values()))))
    for route, scores in zip(named, mixed, strict=True):
        run._record(ROUTE_KEYS[route], run.faults.sampler_scores(scores))
    control = run._timed("mixed_control", lambda: sampler.score_mixed(run.sequences, [run.handle] * len(named)))
    run._record(CONTROL_KEY, run.faults.sampler_scores(control[list(named).index("updated")]))
