"""The experts vLLM's scoring passes routed each token to (issue 52, the GPU part; docs/moe.md).

vLLM 0.26's GPU model runner captures every layer's top-k expert ids when the engine starts with
`enable_return_routed_experts=True` (`RoutedExpertsCapturer`, a buffer of [tokens, num_hidden_layers, top-k]; layers
without experts stay zero) and returns a prompt's as `CompletionOutput.routed_experts`, an array [prompt tokens,
num_hidden_layers, top-k] (`routed_experts_prompt_start` 0: every prompt token). The `vllm` sampler starts a CUDA
engine so for an MoE model and reads them beside its prompt logprobs, in the same pass (`score_with_routes`). Not on
vLLM-CPU: its CPU runner has no capturer. Read in vLLM 0.26.0's source (v1/worker/gpu_model_runner.py,
model_executor/layers/fused_moe/routed_experts_capturer.py, v1/core/sched/scheduler.py, outputs.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from lora_parity.backends.base import Routes, Sequences
from lora_parity.util.errors import ScoreError
from lora_parity.util.escape import one_line

ENGINE_ARG = "enable_return_routed_experts"
CPU_BUILD = "vllm-cpu"
"""The distribution of vLLM's CPU build (the `cpu` extra): its runner returns no routes."""


def cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (a package-metadata look-up: no import of vLLM or torch)."""
    try:
        metadata.distribution(CPU_BUILD)
    except metadata.PackageNotFoundError:
        return False
    return True


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """The decoder layers with routed experts, in order (the layers of HF's routers): Qwen3-MoE leaves
    `mlp_only_layers` dense and routes where (i + 1) % `decoder_sparse_step` == 0; GLM and DeepSeek leave the
    first `first_k_dense_replace` layers dense (DeepSeek then routes where i % `moe_layer_freq` == 0); a config
    with `mlp_layer_types` says it per layer."""
    n = int(config["num_hidden_layers"])
    types = config.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == n:
        return [i for i, kind in enumerate(types) if kind == "sparse"]
    dense_first = int(config.get("first_k_dense_replace") or 0)
    only = {int(i) for i in config.get("mlp_only_layers") or []}
    step, freq = int(config.get("decoder_sparse_step") or 1), int(config.get("moe_layer_freq") or 1)
    return [i for i in range(n) if i >= dense_first and i not in only and (i + 1) % step == 0 and i % freq == 0]


def decoded(text: object, s: int) -> Any:
    """One choice's `routed_experts` from vLLM's `/v1/completions` (0.26: base64 of an `.npy` of [tokens, layers,
    top-k] integers; None where the server was started without --enable-return-routed-experts): the array, read
    without pickle (a server may be a stranger's); a `ScoreError` for anything else."""
    import base64
    import binascii
    import io

    import numpy as np

    if text is None:
        return None
    try:
        if not isinstance(text, str):
            raise ValueError(f"a {type(text).__name__}, not a string")
        array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (ValueError, OSError, binascii.Error, EOFError) as e:
        raise ScoreError(f"vLLM server: the routed experts of sequence {s} are not a base64 .npy array "
                         f"({one_line(str(e))[:120]})") from None
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ScoreError(f"vLLM server: the routed experts of sequence {s} are {array.dtype} of shape {array.shape}, "
                         "not integers of [tokens, layers, top-k]")
    return array


def decoded_raw(text: object, s: int, num_layers: int, top_k: int) -> Any:
    """One answer's `meta_info.routed_experts` from SGLang's `/generate` (0.5.16, `return_routed_experts`: base64 of
    the raw int32 bytes of [tokens, num_hidden_layers, top-k], `state_capturer/routed_experts.py`; absent where the
    server runs without --enable-return-routed-experts): the array; a `ScoreError` for anything else."""
    import base64
    import binascii

    import numpy as np

    if text is None:
        return None
    try:
        if not isinstance(text, str):
            raise ValueError(f"a {type(text).__name__}, not a string")
        flat = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    except (ValueError, binascii.Error) as e:
        raise ScoreError(f"SGLang server: the routed experts of sequence {s} are not base64 int32 "
                         f"({one_line(str(e))[:120]})") from None
    if num_layers < 1 or top_k < 1 or flat.size % (num_layers * top_k):
        raise ScoreError(f"SGLang server: the routed experts of sequence {s} ({flat.size} ids) are not [tokens, "
                         f"{num_layers} layers, top-{top_k}]")
    return flat.reshape(-1, num_layers, top_k)


def routes_of(arrays: Sequence[Any], sequences: Sequences, layers: Sequence[int]) -> Routes:
    """Each sequence's routes ([token][MoE layer] -> sorted expert ids, as the HF side records them) from the
    `routed_experts` arrays its requests returned; a `ScoreError` where one is missing or too short."""
    out: Routes = []
    for s, (seq, array) in enumerate(zip(sequences, arrays, strict=True)):
        shape = getattr(array, "shape", None)
        if array is None or shape is None or len(shape) != 3 or shape[0] < len(seq) or (
                layers and shape[1] <= max(layers)):
            raise ScoreError(f"vLLM returned no routed experts for sequence {s} of {len(seq)} tokens (got "
                             f"{None if shape is None else tuple(shape)}): was the engine started with {ENGINE_ARG}?")
        rows = array[:len(seq)].tolist()
        out.append([[sorted(int(e) for e in rows[t][layer]) for layer in layers] for t in range(len(seq))])
    return out
