"""The user's sampling parameters (issue 44): `--sampling KEY=VALUE` (repeatable) over the config's
`sampler.sampling`, the temperature, top-p and top-k their rollouts are drawn with.

They apply where the sampler generates: the decode path (`--probes sampled`: the `sample` and `generate_updated`
phases). The logprobs compared stay raw (vLLM's default `logprobs_mode`, raw_logprobs: from the logits before
temperature, top-k and top-p), so every G.* check keeps its meaning while the tokens are drawn as the user's rollouts
draw them. Processed logprobs under parameters other than the identity (temperature 1, no top-p, no top-k) would
need the trainer to process its logits the same way: refused in preflight (`refusal`), never compared against raw
scores. Pure: no engine import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lora_parity.util.errors import ConfigError

SAMPLING_SAMPLERS = ("vllm", "vllm-server")
"""The samplers whose generation takes the user's sampling parameters."""


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

    def describe(self) -> str:
        """One line for the receipt's sampler settings (`sampling`)."""
        top_k = str(self.top_k) if self.top_k else "off"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {top_k}"


def parse(items: Iterable[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings as a mapping (values checked by `merged`); a malformed item is a `ConfigError`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise ConfigError(f"--sampling {item!r}: expected KEY=VALUE (temperature, top_p, top_k)")
        out[key] = value.strip()
    return out


def merged(spec: SamplingSpec, given: Mapping[str, Any]) -> SamplingSpec:
    """`spec` with `given` over it, validated; an unknown key or a value out of range is a one-line `ConfigError`."""
    if not given:
        return spec
    try:
        return SamplingSpec.model_validate({**spec.model_dump(), **given})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "sampling"
        raise ConfigError(f"--sampling {where}: {err['msg']}") from None


def refusal(spec: SamplingSpec, sampler: str, engine_args: Mapping[str, Any]) -> str | None:
    """Why this run cannot take `spec` (None: it can). The identity always can."""
    if spec.identity:
        return None
    if sampler not in SAMPLING_SAMPLERS:
        return (f"--sampling: the {sampler} sampler generates with temperature 1 only; the user's sampling parameters "
                f"are built for {', '.join(SAMPLING_SAMPLERS)}")
    mode = str(engine_args.get("logprobs_mode", "raw_logprobs"))
    if mode.startswith("processed"):
        return (f"--sampling with logprobs_mode={mode}: the engine's logprobs would be those after temperature, "
                "top-k and top-p, which the trainer's raw scores cannot be compared with; lora-parity compares raw "
                "logprobs (drop logprobs_mode, or the sampling parameters)")
    return None
