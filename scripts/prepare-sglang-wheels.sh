#!/usr/bin/env bash
# Download the wheels of scripts/gpu-sglang-wheels.txt for the GPU machine (Python 3.12, manylinux x86_64),
# rewrite the sglang-kernel wheel with its members LZMA-compressed (same files, 365 -> about 164 MiB: its
# FA3 library is 1 GB unpacked; pip reads LZMA members through Python's zipfile), then pack them into
# folders of at most 56 MiB, each small enough to travel there in one call (4 folders).
#
#   usage: scripts/prepare-sglang-wheels.sh OUT_DIR     (OUT_DIR should be git-ignored, e.g. .gpu-wheels-sglang)
#
# Result: OUT_DIR/c0 .. OUT_DIR/cN, holding whole wheels or parts of one (NAME.whl.partNN), and OUT_DIR/MANIFEST.
# On the GPU machine, with the vLLM set already installed in /tmp/site (../shared/GPU.md), after copying
# every folder into /tmp/ws:
#   cd /tmp/ws && for w in $(ls *.part00 | sed 's/\.part00$//'); do cat "$w".part* > "$w" && rm "$w".part*; done
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-sglang /tmp/ws/*.whl
#   export PYTHONPATH=/tmp/site-sglang:/tmp/site:$PWD PATH=/tmp/site-sglang/bin:$PATH   # for SGLang runs only
# (a folder of its own: transformers, tokenizers and apache-tvm-ffi there replace the image's and the vLLM set's).
# scripts/gpu-evidence.sh does this: `stash-sglang N` per folder (N = 0..3, .gpu-wheels-sglang/cN carried), then
# `install-sglang`; its `sglang` and `sglang-selftest` steps run under that PYTHONPATH and PATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: prepare-sglang-wheels.sh OUT_DIR}
dl="$out/download"
mkdir -p "$dl"
# The tags the chosen wheels carry (sglang: manylinux_2_34; apache-tvm-ffi: 2_24; pillow, sentencepiece: 2_27).
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
grep -vE '^(#|$)' "$here/gpu-sglang-wheels.txt" | sed 's/[[:space:]]*#.*//' > "$out/pins.txt"
if [ -z "${LORA_PARITY_PACK_ONLY:-}" ]; then  # set: pack what is already in OUT_DIR/download
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${plat[@]}" -d "$dl" -r "$out/pins.txt"
fi
python3 - "$out" <<'PY'
import os, shutil, sys, zipfile
out = sys.argv[1]; dl = os.path.join(out, "download"); limit = 56 * 1024 * 1024
for f in sorted(os.listdir(dl)):  # sglang-kernel: every member LZMA-compressed (a few minutes, one core)
    if not f.startswith("sglang_kernel-"):
        continue
    src, tmp = os.path.join(dl, f), os.path.join(out, f + ".lzma")
    with zipfile.ZipFile(src) as zin:
        if all(i.compress_type == zipfile.ZIP_LZMA for i in zin.infolist()):
            continue  # already rewritten (LORA_PARITY_PACK_ONLY)
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA, allowZip64=True) as zout:
            for info in zin.infolist():
                data = zin.read(info.filename)
                info.compress_type = zipfile.ZIP_LZMA
                zout.writestr(info, data)
    with zipfile.ZipFile(tmp) as check:  # same members, same bytes
        assert check.testzip() is None
    os.replace(tmp, src)
chunks, sizes = [], []
def new_chunk():
    d = os.path.join(out, f"c{len(chunks)}"); os.makedirs(d, exist_ok=True); chunks.append(d); sizes.append(0)
    return len(chunks) - 1
names = sorted(os.listdir(dl))
big = [f for f in names if os.path.getsize(os.path.join(dl, f)) > limit]
for f in big:  # a wheel over the limit travels in parts of the limit, each in a folder of its own
    with open(os.path.join(dl, f), "rb") as src:
        part = 0
        while data := src.read(limit):
            i = new_chunk()
            with open(os.path.join(chunks[i], f"{f}.part{part:02d}"), "wb") as dst:
                dst.write(data)
            sizes[i] += len(data); part += 1
# The small wheels fill the gaps, largest first (first-fit decreasing: fewest folders).
for f in sorted((f for f in names if f not in big), key=lambda f: -os.path.getsize(os.path.join(dl, f))):
    n = os.path.getsize(os.path.join(dl, f))
    i = next((k for k in range(len(chunks)) if sizes[k] + n <= limit), None)
    i = new_chunk() if i is None else i
    shutil.copy(os.path.join(dl, f), chunks[i]); sizes[i] += n
with open(os.path.join(out, "MANIFEST"), "w") as m:
    for d, s in zip(chunks, sizes):
        m.write(f"{os.path.basename(d)} {s / 2**20:.1f} MiB: {' '.join(sorted(os.listdir(d)))}\n")
shutil.rmtree(dl)
print(open(os.path.join(out, "MANIFEST")).read(), end="")
PY
