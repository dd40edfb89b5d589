"""Is an MoE receipt's tail a routing flip? Router top-k margins of every scored position, on the CPU.

Rebuilds, with the project's own code, what a receipt's HF trainer ran: the synthetic checkpoint
(its weights digest must match the receipt's), the probes, the seeded LoRA A and the seeded update
of the B tensors (`HFTrainer.perturb`). For each adapter state (zero-init, the full update, and each
target's update alone, as the receipt's T runs) it scores the probes in the model's dtype (bf16)
and in fp32 on the same weights, and records each MoE layer's router scores as HF ranks them
(sigmoid + correction bias). Per scored position it reports:

- margin: the k-th chosen expert's score minus the best unchosen one (`routing.topk_margin`),
  the smallest over the MoE layers at that token; rank 1 = the smallest of all positions;
- whether bf16 and fp32 choose the same expert sets;
- the receipt's |diff| there (A: trainer_zero vs zero, C: trainer_updated vs updated, T: per target);
- flip: the bf16 logprob with the k-th expert swapped for the best unchosen one at every MoE layer;
- the story that fits the receipt there: both of its sides took the CPU's route (res-same: the larger
  |CPU - receipt side|) or one side took the flipped route (res-split, and which side);
- forced: the bf16 logprob with fp32's routing forced in (what bf16 rounding of the route alone does).

Then, per state, the receipt's |diff| over the positions whose margin is at least the largest router
score |bf16 - fp32| ("noise bound"), and at each `--bounds` value: the tail with the near ties set aside.

Score entry t of a sequence is log p(tokens[t+1] | tokens[:t+1]) (backends/base.py); its router
decision is the one at token t. A flip at an earlier token reaches later positions only through
attention after that layer (none in tiny-glm-dsa, whose only MoE layer is the last).

    python scripts/router-margins.py [--model tiny-glm-dsa] \
        [--receipt receipts/tiny-glm-dsa.std-0.02__hf__vllm__h200.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lora_parity.backends.hf import HFTrainer, score_sequences
from lora_parity.models import config, synthetic
from lora_parity.models.checkpoint import vocab_size, weights_digest
from lora_parity.run import probes as probe_sources
from lora_parity.run import routing
from lora_parity.verdict import stats

DEFAULT_RECEIPT = "receipts/tiny-glm-dsa.std-0.02__hf__vllm__h200.json"


@dataclass
class Pass:
    """One scoring pass: logprobs per sequence, and per sequence the routers' scores [L, T, E] and
    chosen experts [L, T, k] (the forced ones when routing was forced)."""

    logprobs: list[list[float]]
    scores: list[torch.Tensor]
    chosen: list[torch.Tensor]


def _routers(model: Any) -> list[Any]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]


@contextlib.contextmanager
def _routing(model: Any, force: list[torch.Tensor] | None, into: Pass) -> Iterator[None]:
    """Capture every router call (in call order: one sequence per forward, layers in order); with
    `force`, replace its expert choice by the next forced one, weighting as HF does (normalized
    sigmoid scores times routed_scaling_factor)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    queue = iter([layer for seq in force for layer in seq]) if force is not None else None

    def hook(module: Any, args: Any, out: Any) -> Any:
        logits, weights, indices = out
        scores = logits.float().sigmoid() + module.e_score_correction_bias.float()
        if queue is not None:
            indices = next(queue).to(indices.device)
            weights = logits.float().sigmoid().gather(1, indices)
            if module.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * module.routed_scaling_factor
        calls.append((scores.detach().cpu(), indices.detach().cpu()))
        return logits, weights, indices

    hooks = [r.register_forward_hook(hook) for r in _routers(model)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
    num_layers = len(hooks)
    for s in range(0, len(calls), num_layers):
        into.scores.append(torch.stack([c[0] for c in calls[s:s + num_layers]]))
        into.chosen.append(torch.stack([c[1].sort(dim=-1).values for c in calls[s:s + num_layers]]))


def run(model: Any, sequences: list[list[int]], force: list[torch.Tensor] | None = None) -> Pass:
    """Score `sequences` one per forward, capturing (or forcing) the routing."""
    result = Pass([], [], [])
    with _routing(model, force, result):
        result.logprobs = score_sequences(model, sequences, torch.device("cpu"), 1)
    return result


def flipped(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[L, T, k] expert sets with the k-th choice swapped for the best unchosen expert."""
    order = scores.argsort(dim=-1, descending=True)
    return torch.cat([order[..., :top_k - 1], order[..., top_k:top_k + 1]], dim=-1).sort(dim=-1).values


def position_margins(p: Pass, top_k: int) -> list[float]:
    """Per scored position (flattened), the smallest router margin over the MoE layers at its token."""
    out = []
    for scores in p.scores:
        for t in range(scores.shape[1] - 1):
            out.append(min(routing.topk_margin(scores[layer, t].tolist(), top_k) for layer in range(scores.shape[0])))
    return out


def same_sets(a: Pass, b: Pass) -> list[bool]:
    """Per scored position, whether both passes chose the same expert set at every MoE layer."""
    return [bool(torch.equal(ca[:, t], cb[:, t])) for ca, cb in zip(a.chosen, b.chosen, strict=True)
            for t in range(ca.shape[1] - 1)]


def check_own_choice(p: Pass, top_k: int) -> None:
    """The router's own choice must be the top-k of the scores recomputed here (else the margins
    describe another ranking: group-limited routing, another scoring function)."""
    for scores, chosen in zip(p.scores, p.chosen, strict=True):
        mine = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values
        if not torch.equal(mine, chosen):
            raise SystemExit("the router's choice is not the top-k of sigmoid + bias: margins would be wrong")


@dataclass
class StateResult:
    """Everything measured for one adapter state."""

    name: str
    margins: list[float]
    same: list[bool]
    receipt_diff: list[float]
    sampler: list[float]
    trainer: list[float]
    """The receipt's scores of this state: its sampler's and its (GPU) trainer's."""
    bf16: list[float]
    fp32: list[float]
    flip: list[float]
    forced_fp32: list[float]
    score_noise: list[float]
    """|bf16 - fp32| router score, every (token, layer, expert)."""


def measure(name: str, model: Any, sequences: list[list[int]], receipt_pair: tuple[list[float], list[float]],
            top_k: int) -> StateResult:
    """Score one adapter state in bf16, fp32, with flipped and with fp32-forced routing."""
    bf16 = run(model, sequences)
    check_own_choice(bf16, top_k)
    fp32_model = copy.deepcopy(model).float()
    fp32 = run(fp32_model, sequences)
    del fp32_model
    flip = run(model, sequences, [flipped(s, top_k) for s in bf16.scores])
    forced = run(model, sequences, fp32.chosen)
    sampler, trainer = receipt_pair
    noise = torch.cat([(a - b).abs().flatten() for a, b in zip(bf16.scores, fp32.scores, strict=True)])
    return StateResult(name, position_margins(bf16, top_k), same_sets(bf16, fp32),
                       [abs(x - y) for x, y in zip(sampler, trainer, strict=True)], sampler, trainer,
                       stats.flatten(bf16.logprobs), stats.flatten(fp32.logprobs), stats.flatten(flip.logprobs),
                       stats.flatten(forced.logprobs), noise.tolist())


def _q(values: list[float], q: float) -> float:
    return stats.quantile(sorted(values), q)


def _tail(values: list[float]) -> str:
    return f"mean {math.fsum(values) / len(values):.4f}, p99 {_q(values, 0.99):.4f}, max {max(values):.4f}"


def split_route(r: StateResult, i: int) -> tuple[str, float, float]:
    """Which story fits position i better: both receipt sides took the CPU bf16 route ('same'), or one
    side took the flipped route ('sampler flipped' / 'trainer flipped'), with the worst residual
    |CPU - receipt side| of each story (same, best split)."""
    own, flip, s, t = r.bf16[i], r.flip[i], r.sampler[i], r.trainer[i]
    same = max(abs(own - s), abs(own - t))
    sampler_flipped = max(abs(flip - s), abs(own - t))
    trainer_flipped = max(abs(own - s), abs(flip - t))
    # A flip story must at least halve the residual; short of that both stories are noise.
    if 2 * min(sampler_flipped, trainer_flipped) >= same:
        return "same", same, min(sampler_flipped, trainer_flipped)
    who = "sampler flipped" if sampler_flipped < trainer_flipped else "trainer flipped"
    return who, same, min(sampler_flipped, trainer_flipped)


def _row(r: StateResult, i: int, rank: int, lengths: list[int]) -> str:
    where = stats.locate([[0.0] * k for k in lengths], i)
    story, same, split = split_route(r, i)
    return (f"  {where!s:10} {r.receipt_diff[i]:10.4f}  {r.margins[i]:.2e}  {rank:4d}  {r.same[i]!s:5} "
            f"{abs(r.bf16[i] - r.fp32[i]):11.4f}  {r.flip[i] - r.bf16[i]:+9.4f}  {r.forced_fp32[i] - r.bf16[i]:+11.4f}"
            f"  {same:8.4f}  {split:8.4f}  {story}")


def report(r: StateResult, lengths: list[int], worst: int) -> None:
    """Print one state's margins, and the receipt's worst positions among them."""
    n = len(r.margins)
    rebuilt = [abs(a - b) for a, b in zip(r.bf16, r.trainer, strict=True)]
    print(f"\n== {r.name}: {n} positions; receipt |diff| {_tail(r.receipt_diff)}")
    print(f"CPU bf16 vs the receipt's trainer: {_tail(rebuilt)}")
    print(f"router score |bf16 - fp32|: p99 {_q(r.score_noise, 0.99):.2e}, max {max(r.score_noise):.2e}; "
          f"bf16 and fp32 choose the same experts at {sum(r.same)}/{n} positions")
    print(f"margins, all positions: min {min(r.margins):.2e}, p1 {_q(r.margins, 0.01):.2e}, "
          f"p5 {_q(r.margins, 0.05):.2e}, median {_q(r.margins, 0.5):.2e}")
    order = sorted(range(n), key=lambda i: -r.receipt_diff[i])[:worst]
    ranks = routing.margin_ranks(r.margins, order)
    print("  (seq,pos)  receipt|d|  margin    rank  same  |bf16-fp32|  flip-bf16  forced-bf16"
          "  res-same res-split story")
    for i, rank in zip(order, ranks, strict=True):
        print(_row(r, i, rank, lengths))
    smallest = sorted(range(n), key=lambda i: r.margins[i])[:worst]
    print(f"  the {worst} smallest margins are at "
          f"{[stats.locate([[0.0] * k for k in lengths], i) for i in smallest]}")


def excluded_tail(r: StateResult, bound: float) -> str:
    """The receipt's |diff| over positions whose margin is at least `bound`, and the excluded ones."""
    kept = [d for d, m in zip(r.receipt_diff, r.margins, strict=True) if m >= bound]
    out = [d for d, m in zip(r.receipt_diff, r.margins, strict=True) if m < bound]
    excluded = f"{len(out)} excluded (max |diff| {max(out):.4f})" if out else "none excluded"
    return f"margin >= {bound:.2e}: {len(kept)} kept, {_tail(kept)}; {excluded}"


def states(cfg: config.ModelConfig) -> list[tuple[str, str | None, str, str]]:
    """(label, the update's target: None every one, "zero" none; the receipt's sampler and trainer
    score keys) of each adapter state the receipt compared."""
    out = [("A zero-init", "zero", "zero", "trainer_zero"), ("C updated", None, "updated", "trainer_updated")]
    return out + [(f"T {kind}", kind, f"target.{kind}.sampler", f"target.{kind}.trainer")
                  for kind in cfg.adapter.targets]


@dataclass
class Rebuilt:
    """The receipt's HF trainer, rebuilt on the CPU."""

    cfg: config.ModelConfig
    trainer: HFTrainer
    sequences: list[list[int]]
    top_k: int
    receipt: dict[str, Any]


def rebuild(model: str, receipt: dict[str, Any]) -> Rebuilt:
    """The config's checkpoint, probes and seeded trainer; refuses if they are not the receipt's."""
    cfg = config.load(model)
    model_dir = synthetic.materialize(cfg)
    if weights_digest(model_dir) != receipt["model"]["weights_digest"]:
        raise SystemExit("the checkpoint rebuilt here is not the receipt's (weights digest differs)")
    settings = receipt["trainer"]["settings"]
    adapter = (cfg.adapter.rank, float(cfg.adapter.alpha), list(cfg.adapter.targets))
    if adapter != (settings["rank"], float(settings["alpha"]), settings["targets"]):
        raise SystemExit("the config's adapter (rank, alpha, targets) is not the receipt's trainer's")
    sequences = probe_sources.make(cfg, receipt["probes"]["set"], lambda: vocab_size(cfg)).sequences
    if sequences != receipt["probes"]["sequences"]:
        raise SystemExit("the probes rebuilt here are not the receipt's")
    trainer = HFTrainer(cfg, model_dir, receipt["perturbation"]["seed"], {})
    return Rebuilt(cfg, trainer, sequences, _routers(trainer.model)[0].top_k, receipt)


def update_std(perturbation: dict[str, Any], only: str | None) -> float:
    """The std the receipt's run used for the update of `only` (None: the full update): a per-target
    search's chosen std (its last step) where `perturbation.std: auto` ran one, else the run's std."""
    searched = (perturbation.get("target_calibrations") or {}).get(only) if only is not None else None
    return float(searched["steps"][-1]["std"]) if searched else float(perturbation["std"])


def measure_state(r: Rebuilt, label: str, only: str | None, sampler_key: str, trainer_key: str) -> StateResult:
    """Put the trainer in one adapter state (zero-init, or the receipt's seeded update of `only`'s B
    tensors, every target's when None) and measure it against the receipt's scores of that state."""
    update = r.receipt["perturbation"]
    r.trainer.zero_b()
    if only != "zero":
        r.trainer.perturb(update_std(update, only), update["seed"], only=only)
    scores = r.receipt["scores"]
    pair = (stats.flatten(scores[sampler_key]), stats.flatten(scores[trainer_key]))
    return measure(label, r.trainer.model, r.sequences, pair, r.top_k)


def main() -> None:
    """Rebuild the receipt's trainer on the CPU and report router margins per adapter state."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-glm-dsa")
    parser.add_argument("--receipt", type=Path, default=Path(DEFAULT_RECEIPT))
    parser.add_argument("--worst", type=int, default=5, help="how many of the receipt's worst positions to show")
    parser.add_argument("--bounds", type=float, nargs="*", default=[1e-3, 3e-3, 1e-2],
                        help="margin bounds below which a position is set aside, for the what-if tails")
    parser.add_argument("--json", type=Path, help="write every position's numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rebuilt = rebuild(args.model, json.loads(args.receipt.read_text()))
    lengths = [len(s) - 1 for s in rebuilt.sequences]
    results = []
    for state in states(rebuilt.cfg):
        results.append(measure_state(rebuilt, *state))
        report(results[-1], lengths, args.worst)
        print("  noise bound (the largest router score |bf16 - fp32|): "
              + excluded_tail(results[-1], max(results[-1].score_noise)))
        for bound in args.bounds:
            print("  what-if " + excluded_tail(results[-1], bound))
    if args.json:
        args.json.write_text(json.dumps([vars(r) | {"score_noise": None} for r in results]))


if __name__ == "__main__":
    main()
