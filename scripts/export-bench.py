"""Issue 47: an adapter export and a kept point's tensors for the references, each the way before and now, on a
SmolLM2-135M-shaped adapter (random weights, bf16, PEFT LoRA r8 on the seven projections: 420 tensors), medians of
alternating rounds. Export: `to_host_all` + safetensors' `save_file` against `adapter_export.write_safetensors` (the
bytes compared); a point's (A, B) for the fp32 reference: `copy_raw` into tensors of their own against
`raw_tensors.views_on` (the values compared). On the GPU machine the tensors start on the GPU.

    python scripts/export-bench.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import save_file

from lora_parity.backends.adapter_export import saved_name, write_safetensors
from lora_parity.backends.raw_tensors import copy_raw, to_host_all, to_raw_all, views_on


def medians(ways: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, way in (list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            way()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets)).to(device).eval()
    lora = [(saved_name(n), p) for n, p in model.named_parameters() if "lora_" in n]
    folder = Path(tempfile.mkdtemp(prefix="export-bench-"))
    exports = {
        "save_file": lambda: save_file(to_host_all(lora), str(folder / "a.safetensors"), metadata={"format": "pt"}),
        "write_safetensors": lambda: write_safetensors(folder / "b.safetensors", lora, {"format": "pt"}),
    }
    got = medians(exports, args.rounds)
    same = (folder / "a.safetensors").read_bytes() == (folder / "b.safetensors").read_bytes()
    print(f"export ({len(lora)} tensors, {device.type}): " + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in got.items())
          + f" ({got['save_file'] / got['write_safetensors']:.2f}x); bytes equal: {same}")
    state = to_raw_all(lora)
    names = list(state)

    def own() -> dict[str, torch.Tensor]:
        params = {n: torch.empty(list(state[n][1]), dtype=torch.float32, device=device) for n in names}
        copy_raw(params, state, device)
        return params

    points = {"copy_raw": own, "views_on": lambda: views_on(state, names, device, torch.float32)}
    got = medians(points, args.rounds)
    a, b = own(), views_on(state, names, device, torch.float32)
    print(f"a kept point's tensors in fp32 ({device.type}): "
          + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in got.items())
          + f" ({got['copy_raw'] / got['views_on']:.2f}x); values equal: {all(torch.equal(a[n], b[n]) for n in names)}")


if __name__ == "__main__":
    main()
