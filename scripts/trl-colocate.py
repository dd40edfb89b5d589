"""TRL's GRPOTrainer (PEFT LoRA, vLLM colocate) on a checkpoint folder, checked through TRL's own sync and engine:
a clean check, then each planted TRL-path fault (lora_parity.stacks.trl.faults), one receipt each. For the GPU
machine (scripts/gpu-plans/trl.md): vLLM's CPU build cannot take TRL's colocate sync (docs/trl.md).

    python3 scripts/trl-colocate.py CHECKPOINT OUT_DIR [--faults a,b|all|none] [--sleep] [--steps N] [--revision REV]
        [--coverage full|targets|none]

The trainer is built as a user's GRPO script builds it (a toy length reward, a two-prompt dataset), trains STEPS
optimizer steps (TRL syncs and rolls out on its own), then `check_trl` runs once per fault on the same trainer and
engine. Each receipt is OUT_DIR/trl-colocate[-sleep].NAME__DEVICE.json; one JSON line per run on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL reaches the engine's model in this process

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_trainer(checkpoint: str, out_dir: Path, sleep: bool, rank: int) -> object:
    import pyarrow as pa
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    # datasets 5.2 with dill 0.4.1 cannot hash an arrow table (PicklingError on MonthDayNano): give the fingerprint.
    dataset = Dataset(pa.table({"prompt": ["Write a short poem about the sea.", "Name three prime numbers."]}),
                      fingerprint="lora-parity-trl")

    def length_reward(completions: list[str], **_: object) -> list[float]:
        return [1.0 / (1 + len(c)) for c in completions]

    bf16 = torch.cuda.is_available()
    args = GRPOConfig(output_dir=str(out_dir / "trl-run"), use_vllm=True, vllm_mode="colocate",
                      vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=sleep, vllm_max_model_length=512,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=16, learning_rate=1e-3,
                      max_steps=100, report_to=[], save_strategy="no", logging_steps=1, bf16=bf16,
                      use_cpu=not bf16, model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32})
    if os.environ.get("LORA_PARITY_TRL_EAGER"):  # vLLM 0.26 on an H100: TRL's graph capture hit an illegal access
        import functools

        import trl.generation.vllm_generation as generation

        generation.LLM = functools.partial(generation.LLM, enforce_eager=True)
    peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    return GRPOTrainer(model=checkpoint, reward_funcs=length_reward, args=args, train_dataset=dataset,
                       peft_config=peft_config)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--faults", default="all")
    parser.add_argument("--sleep", action="store_true", help="vllm_enable_sleep_mode=True")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps before the checks")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--revision", default=None)
    parser.add_argument("--device", default="gpu", help="the card, in receipt names")
    parser.add_argument("--coverage", choices=("full", "targets", "none"), default="full",
                        help="per-target and per-layer coverage (full), per-target only, or neither: each covered "
                             "target or layer group is one more TRL sync, which pushes every base weight")
    a = parser.parse_args()

    from lora_parity.stacks.trl import FAULTS, ParityCallback, check_trl

    a.out_dir.mkdir(parents=True, exist_ok=True)
    faults = list(FAULTS) if a.faults == "all" else [] if a.faults == "none" else a.faults.split(",")
    start = time.perf_counter()
    trainer = build_trainer(a.checkpoint, a.out_dir, a.sleep, a.rank)
    vocab = trainer.model.config.vocab_size
    rng = random.Random(1001)
    sequences = [[rng.randrange(vocab) for _ in range(n)] for n in (65, 129)]
    tag = "trl-colocate-sleep" if a.sleep else "trl-colocate"
    # The clean check runs inside trainer.train(), from the callback at the last step; the faults after it.
    coverage = {"per_target": a.coverage != "none", "per_layer": a.coverage == "full"}
    callback = ParityCallback(sequences, at_step=a.steps, out=a.out_dir / f"{tag}.clean__{a.device}.json",
                              revision=a.revision, force=True, **coverage).attach(trainer)
    trainer.args.max_steps = a.steps
    trainer.train()
    print(json.dumps({"setup_and_train_s": round(time.perf_counter() - start, 1)}), flush=True)
    runs = [("clean", callback.result)]
    for name in faults:
        t = time.perf_counter()
        result = check_trl(trainer, sequences, fault=name, out=a.out_dir / f"{tag}.{name}__{a.device}.json",
                           revision=a.revision, force=True, **coverage)
        runs.append((name, result))
        print(f"# {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    ok = True
    for name, result in runs:
        if result is None:
            print(json.dumps({"run": name, "verdict": "not run"}), flush=True)
            ok = False
            continue
        check = "" if name == "clean" else FAULTS[name].check(bool(result.receipt.sampler.settings.get("sleep_mode")))
        expected = "pass" if name == "clean" else f"fail, caught by {check}"
        met = result.passed if name == "clean" else check in result.failed_checks
        ok = ok and met
        print(json.dumps({"run": name, "verdict": result.verdict.value, "expected": expected, "met": met,
                          "failed": result.failed_checks[:12], "receipt": str(result.path),
                          "sampler": result.receipt.sampler.settings}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
