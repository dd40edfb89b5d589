"""Route replay (R3) and route capture on a `Shard`'s MoE routers, through megatron-core's own router replay
(`moe_enable_routing_replay`, `RouterReplay`).

Each MoE layer's `TopKRouter` holds a `RouterReplay`. Replaying, it is given the layer's target indices
[tokens, k] and the action REPLAY_FORWARD: `topk_routing_with_score_function` then takes those experts instead
of its top-k, and weighs them by its own scores gathered there (`model`: the softmax over the replayed
experts' logits, which is Qwen3-MoE's softmax over every expert renormalized over the replayed set with
norm_topk_prob, or the softmax over every expert as it is without). Recording (RECORD), the router keeps the
indices of its own top-k. The router sees the tokens of one forward as [sequence, batch] flattened; a `Shard`
runs one sequence per forward (batch 1), so its tokens come in sequence order, the order of a `RouteTable`'s.

The routes are set for the one forward of one sequence and cleared after it (`RouterReplay` also keeps each
target for a recompute in backward, which nothing here runs: no activation recompute). megatron-core keeps
every `RouterReplay` in a class-level list; the Shard's are taken out of it when it closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lora_parity.backends.base import Routes, Sequences
from lora_parity.util.errors import PhaseError

REPLAYED_WEIGHTS = (
    "the trainer's own router's, over the replayed experts (megatron-core's RouterReplay, REPLAY_FORWARD): the "
    "softmax over the replayed experts' logits, which is Qwen3-MoE's softmax over every expert renormalized over "
    "them where norm_topk_prob is set (moe_router_pre_softmax off); without norm_topk_prob the softmax over "
    "every expert read at them (moe_router_pre_softmax on)")
"""How the Megatron trainer weighs replayed experts (megatron-core 0.16.1's `topk_routing_with_score_function`)."""

Table = dict[tuple[int, ...], list[list[list[int]]]]


class Routing:
    """The MoE routers of one model (its layers' `mlp.router`, in layer order) and the routes they replay."""

    def __init__(self, model: Any, num_experts: int, top_k: int) -> None:
        self.routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
        if any(r.router_replay is None for r in self.routers):
            raise PhaseError("megatron-core built an MoE router without router replay (moe_enable_routing_replay)")
        self.num_experts, self.top_k = num_experts, top_k
        self.table: Table | None = None
        """The routes replayed now, by sequence; None: the routers' own choice."""

    def replay(self, routes: list[list[Any]] | None) -> None:
        """Replay `routes` ([[sequence, its routes [token][MoE layer] -> experts], ...]) from now on; None: stop."""
        if routes is not None and not self.routers:
            raise PhaseError("route replay: the model has no MoE routers")
        self.table = None if routes is None else {tuple(seq): token_routes for seq, token_routes in routes}

    def _targets(self, seq: list[int]) -> torch.Tensor:
        """The replayed experts of `seq`'s tokens, [MoE layer, token, k]; `PhaseError` for a sequence without
        routes, routes of another shape, or expert ids out of range or repeated within a token."""
        assert self.table is not None
        token_routes = self.table.get(tuple(seq))
        if token_routes is None:
            raise PhaseError(f"route replay: no routes for this sequence of {len(seq)} tokens ({seq[:4]}...)")
        given = torch.tensor(token_routes, dtype=torch.long)
        if given.dim() != 3 or tuple(given.shape) != (len(seq), len(self.routers), self.top_k):
            raise PhaseError(f"route replay: routes of shape {tuple(given.shape)} for {len(seq)} tokens, "
                             f"{len(self.routers)} MoE layers, top-{self.top_k}")
        if given.min() < 0 or given.max() >= self.num_experts:
            raise PhaseError(f"route replay: expert ids must be in 0..{self.num_experts - 1}")
        if (given.sort(dim=-1).values.diff(dim=-1) == 0).any():
            raise PhaseError("route replay: a token is given the same expert twice")
        return given.permute(1, 0, 2)

    @contextlib.contextmanager
    def forward(self, seq: list[int]) -> Iterator[None]:
        """Within: the model's one forward of `seq` (and its backward) replays `seq`'s routes, where routes are
        replayed; otherwise the routers choose."""
        if self.table is None or not self.routers:
            yield
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        targets = self._targets(seq)
        try:
            for router, target in zip(self.routers, targets, strict=True):
                router.router_replay.set_target_indices(target.contiguous())
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            yield
        finally:
            self._clear()

    def own(self, sequences: Sequences, run: Any) -> Routes | None:
        """Each token's own top-k experts in every MoE layer ([sequence][token][layer], ids ascending), read
        from the routers' RECORD, one forward of each sequence by `run(seq)`; None for a dense model."""
        if not self.routers:
            return None
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routes: Routes = []
        try:
            for seq in sequences:
                for router in self.routers:
                    router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
                run(seq)
                chosen = [router.router_replay.get_recorded_indices().reshape(len(seq), -1).cpu().tolist()
                          for router in self.routers]
                routes.append([[sorted(int(e) for e in layer[t]) for layer in chosen] for t in range(len(seq))])
                self._clear()
        finally:
            self._clear()
        return routes

    def _clear(self) -> None:
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def close(self) -> None:
        """Take this model's `RouterReplay`s out of megatron-core's class-level list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(r.router_replay) for r in self.routers}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
        self.routers = []
