"""Option types shared by the commands (typer `Annotated` aliases), and the verdict → exit code map."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lora_parity.util.errors import EXIT_BAD_INPUT, EXIT_FAIL, EXIT_PASS

JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")]
RevisionOpt = Annotated[str | None, typer.Option(help="Commit under test (default: git rev-parse HEAD).")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="Config name in configs/, a YAML file, or a local HF checkpoint folder.")
]
GithubSummaryOpt = Annotated[
    bool, typer.Option("--github-summary", help="Also append the markdown report to $GITHUB_STEP_SUMMARY, if set.")
]
PublicKeyOpt = Annotated[Path | None, typer.Option(
    help="Check each signed receipt's ed25519 signature with this public key (PEM); without it a signed "
         "receipt reads 'signature not checked'.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size of the trainer (megatron only).")]
TrainerOpt = Annotated[str, typer.Option(
    help="Trainer backend: hf, exact (GPU: scores through vLLM's own ops), megatron, tinker, or an installed "
         "plugin's (entry-point group lora_parity.trainers).")]
SamplerOpt = Annotated[str, typer.Option(help="Sampler backend: vllm, vllm-server, sglang (GPU), hf, tinker, or an "
                                              "installed plugin's (entry-point group lora_parity.samplers).")]
SamplerUrlOpt = Annotated[str | None, typer.Option(
    help="Attach --sampler vllm-server or sglang to this running server instead of starting one (recorded "
         "without credentials).")]
ApiKeyEnvOpt = Annotated[str | None, typer.Option(
    help="Environment variable holding the server's API key (--sampler vllm-server or sglang; never recorded).")]
SharedDirOpt = Annotated[Path | None, typer.Option(
    help="Folder the attached server can read; adapters are copied there (--sampler vllm-server or sglang).")]
ProbesOpt = Annotated[str, typer.Option(
    help="Probe source: random[:SET] or a set (default, held-out; SET-xN: N times the sequences), "
         "text[:SET] (shipped English text, real models only), sampled[:SET] (text prompts the sampler "
         "completes at the start of the run; also checks its generation path after sync), or FILE.jsonl "
         "({\"tokens\": [ids]} or {\"text\": ...} per line).")]
SeedOpt = Annotated[int, typer.Option(help="Run seed: LoRA A init and the perturbation.")]
SyncOpt = Annotated[str, typer.Option(
    help="How adapters reach the sampler: new-id, inplace, merged, memory or tensors.")]
UpdateOpt = Annotated[str | None, typer.Option(
    "--update", help="The trainer's update: noise (seeded noise on LoRA B) or step (one AdamW step on A and B from "
                     "a seeded warm start, its learning rate searched); default: the config's perturbation.update.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Allow a config that sets model.trust_remote_code: true to run the checkpoint's "
                                "own Python code (refused without this flag).")]
ReferenceOpt = Annotated[str | None, typer.Option(
    help="fp32: score the base model in fp32 with HF (comparisons R.*); none: don't. Default: scored for a "
         "bf16/fp16 model whose fp32 copy fits in memory.")]
ExactReferenceOpt = Annotated[bool, typer.Option(
    "--exact-reference/--no-exact-reference",
    help="Where the sampler's arithmetic can be mirrored bit for bit (the vllm sampler on CUDA, Llama and Qwen3): "
         "score the trainer's tensors that way at every point; the engine must equal it (checks E.*).")]
BatchInvariantOpt = Annotated[bool, typer.Option(
    "--batch-invariant/--no-batch-invariant",
    help="vLLM on CUDA: batch-invariant kernels (VLLM_BATCH_INVARIANT=1), so repeated scoring is exact; "
         "SGLang: --enable-deterministic-inference.")]
EngineArgOpt = Annotated[list[str] | None, typer.Option(
    "--engine-arg", metavar="KEY=VALUE",
    help="An engine argument as you deploy it (repeatable; over the config's sampler.engine_args), e.g. "
         "enforce_eager=false, enable_prefix_caching=true, logprobs_mode=processed_logprobs: passed to LLM(...) "
         "and vllm serve as given; with --sampler sglang, SGLang's server arguments (disable_radix_cache=true); "
         "unknown or unsafe keys are refused (docs/deployment.md).")]
SleepLevelsOpt = Annotated[str | None, typer.Option(
    "--sleep-levels", metavar="LEVELS",
    help="Sleep levels to exercise after the sync, comma-separated (1,2) or none: sleep -> sync -> wake -> score, and "
         "a second sleep and wake without a sync (checks W.*); default: the config's sampler.sleep_levels. vLLM needs "
         "--engine-arg enable_sleep_mode=true; vLLM-CPU has none (docs/deployment.md).")]
SamplingOpt = Annotated[list[str] | None, typer.Option(
    "--sampling", metavar="KEY=VALUE",
    help="Your rollouts' sampling parameter (repeatable; over the config's sampler.sampling): temperature, top_p or "
         "top_k, used where the sampler generates (--probes sampled); the logprobs compared stay raw "
         "(docs/deployment.md).")]
LoopOpt = Annotated[list[str] | None, typer.Option(
    "--loop", metavar="KEY=VALUE",
    help="What your RL loop does between a sync and the next scoring (repeatable; over the config's sampler.loop): "
         "reset_prefix_cache=true (it clears the engine's prefix cache after each sync; checks P then test the "
         "reset), wake=all (after a sleep it wakes everything, then syncs; default split: the weights, the sync, "
         "the KV cache), bucket_mb=N (with --sync memory: it hands the merged weights over in buckets of at most N "
         "MB, each its own engine reload) (docs/deployment.md).")]
PerTargetOpt = Annotated[bool | None, typer.Option(
    "--per-target/--no-per-target", help="Per-target coverage after C (default: the config's per_target).")]
RouteReplayOpt = Annotated[str | None, typer.Option(
    "--route-replay", help="MoE models: the trainer's routers replay the experts the engine's pass of each point "
                           "chose (R3, as MoE RL stacks train): on (refused where a side cannot), off, or auto "
                           "(on where both sides can; default: the config's route_replay, else auto). docs/moe.md.")]
PerLayerOpt = Annotated[bool, typer.Option(
    "--per-layer/--no-per-layer", help="Per-layer coverage after per-target coverage: each target in each group "
                                       "of 4 decoder layers alone, for models of more than 4 layers (default on).")]
BudgetsOpt = Annotated[str | None, typer.Option(
    "--budgets", help="Budget profile replacing the config's budgets: seed (the original absolute table), fp32 "
                      "(absolute, tight), bf16 (C relative to A, A against the fp32 reference, noise-derived "
                      "delta thresholds) or exact (bf16's, with A and C bitwise: --trainer exact on the GPU); see "
                      "docs/verdicts.md.")]


def exit_for(verdict: str) -> int:
    """0 for pass, 1 for fail or inconclusive, 2 for error."""
    return EXIT_PASS if verdict == "pass" else EXIT_FAIL if verdict in ("fail", "inconclusive") else EXIT_BAD_INPUT
AdapterOpt = Annotated[Path | None, typer.Option(
    "--adapter", help="A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) both sides start "
                      "from instead of zero-init; its rank, alpha and targets replace the config's.")]
