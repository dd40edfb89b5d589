#!/usr/bin/env bash
# Issue 45's layer faults on the CPU: each planted from outside the tool, in the adapter file between export and load
# (scripts/export-fault-site), over seeds; then scripts/layer-faults.py tallies whether each run failed and named the
# layers and module the fault touched. Usage: bash scripts/layer-faults.sh OUT MODEL SEEDS [FAULT ...]
#   bash scripts/layer-faults.sh /tmp/lf smollm2-135m-bf16 5 upper-half previous zero-b:down_proj
# EXTRA="--no-per-layer" passes more arguments to every run (the file check names the layers without per-layer runs).
set -uo pipefail
out=$1 model=$2 seeds=$3; shift 3
faults=("$@"); [ ${#faults[@]} -gt 0 ] || faults=(upper-half previous zero-b:down_proj)
root=$(cd "$(dirname "$0")/.." && pwd)
lp=${LP:-$root/.venv/bin/lora-parity}
mkdir -p "$out"
for fault in "${faults[@]}"; do
  for ((seed = 0; seed < seeds; seed++)); do
    name="$out/$model.${fault//:/-}.seed-$seed"
    EXPORT_FAULT=$fault PYTHONPATH="$root/scripts/export-fault-site${PYTHONPATH:+:$PYTHONPATH}" \
      "$lp" run --model "$model" --seed "$seed" --out "$name.json" --force ${EXTRA:-} > "$name.txt" 2>&1
    echo "$fault seed $seed: exit $?"
  done
done
"$root/.venv/bin/python" "$root/scripts/layer-faults.py" "$out"/*.json
