"""The `megatron` backend: a megatron-core `GPTModel` with the project's tensor-parallel LoRA.

One module per layer, lowest first (each imports only those above it):
- `layout`: HF ↔ megatron-core names, the model's `Shape`, and the tensor-parallel slices (qkv
  interleave by KV group, fc1 gate/up, row/column/vocabulary splits). Pure; no torch, no megatron.
- `protocol`: the driver ↔ rank 0 command lines. Pure.
- `cpu`: what megatron-core needs to run without CUDA, each workaround with its reason.
- `lora`: the LoRA layers around megatron-core's parallel linears.
- `model`: the `GPTModel` for a `Shape` (dense, or Qwen3-MoE with megatron-core's MoE layer at TP=1).
- `routes`: route replay and route capture on the MoE routers (megatron-core's `RouterReplay`).
- `shards`: one rank's model (`Shard`): build, load, score, perturb, replay routes, gather and export.
- `liveness`: each rank's heartbeats through the rendezvous store (a lost rank is named, within
  `LORA_PARITY_RANK_TIMEOUT`, instead of a hang) and its placement (node, host digest).
- `ranks`: the driver's side of TP=N; `serve`: the rank process (`python -m ...megatron.serve`).
- `trainer`: `MegatronTrainer`, the registered `Trainer`.

This package imports nothing on import, so `layout` and `protocol` load without torch. No module
here imports the CLI or the runner; torchrun's entry point is `python -m lora_parity.launch`
(several nodes: docs/multinode.md).
"""
