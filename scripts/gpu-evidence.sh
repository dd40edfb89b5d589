#!/usr/bin/env bash
# GPU evidence for lora-parity, run on the GPU machine through the device tool (see ../README.md,
# "GPU evidence"). Each STEP is one device call; run them back to back on one warm machine.
#
#   stash N        copy the wheel folder .gpu-wheels/cN (carried along) to /tmp/w
#   install        assemble and install vLLM 0.26.0 and its extra wheels into /tmp/site
#   calibrate      generate the synthetic checkpoints; one run per model, printed as JSON
#   evidence REV   default and held-out runs per model + selftest: receipts into $OUT/evidence.tgz
#   bench          per-phase times, sync latency, 10x probe tokens: $OUT/bench.txt
#
# The wheels come from ../shared/gpu/prepare-vllm-wheels.sh (GPU.md); the machine's image already has
# torch 2.11 (CUDA 13), transformers, PEFT, typer and rich. Nothing is downloaded there.
set -euo pipefail
step=${1:?usage: gpu-evidence.sh STEP [ARG]}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export LORA_PARITY_CACHE=/tmp/lora-parity-cache HF_HUB_OFFLINE=1
models=(qwen3-0.6b-synth qwen3-8b-synth)
device=h200

case "$step" in
  stash)
    mkdir -p /tmp/w && cp ".gpu-wheels/c${2:?chunk}"/* /tmp/w/ && ls /tmp/w | wc -l ;;
  install)
    cd /tmp/w
    if ls vllm-*.part* >/dev/null 2>&1; then
      cat vllm-*.part* > vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl && rm vllm-*.part*
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
    python3 -c "import vllm, pydantic, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))" ;;
  calibrate)
    for m in "${models[@]}"; do
      python3 -m lora_parity run --model "$m" --out "$out/calibrate-$m.json" --revision calibration --json \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['verdict'], d['failed_checks'], {k: {s: round(x, 4) for s, x in v.items()} for k, v in d['comparisons'].items()})" || true
    done
    python3 scripts/model-stats.py "${models[@]}" | tee "$out/model-stats.txt" ;;
  evidence)
    rev=${2:?revision}
    rm -rf /tmp/ev && mkdir -p /tmp/ev
    for m in "${models[@]}"; do
      for p in default held-out; do
        suffix=$([ "$p" = default ] && echo "" || echo ".held-out")
        python3 -m lora_parity run --model "$m" --probes "$p" --revision "$rev" \
          --out "/tmp/ev/${m}${suffix}__hf__vllm__${device}.json" --json > "/tmp/ev/${m}${suffix}.summary.json" || true
      done
    done
    python3 -m lora_parity selftest --model qwen3-0.6b-synth --out-dir /tmp/ev/selftest --json > /tmp/ev/selftest-qwen3-0.6b-synth.json || true
    tar czf "$out/evidence.tgz" -C /tmp/ev . && ls -la /tmp/ev ;;
  bench)
    {
      python3 scripts/bench.py --model qwen3-0.6b-synth --runs 3
      python3 scripts/bench.py --model qwen3-0.6b-synth --runs 3 --probes default-x10
    } 2>&1 | tee "$out/bench.txt" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
