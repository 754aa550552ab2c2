"""The machine a bench ran on, and the --json file the benches write.

``machine()`` is what a result needs to be compared with another: the CPU's
model and the SIMD flags that pick kernels (ggml's, torch's, the mask
code's), the core count, the versions of the engines compared, the commit.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

#: The CPU flags that pick kernels: ggml's ISA levels, bf16 matmuls (AMX, AVX512-BF16).
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx_vnni", "amx_bf16", "amx_int8")
#: Distribution names of the engines and stacks the benches compare.
PACKAGES = ("guided", "torch", "transformers", "xgrammar", "llguidance", "llama-cpp-python")
ROOT = Path(__file__).resolve().parents[1]


def cpu() -> tuple[str, set[str]]:
    """The CPU's model name and all its flags (/proc/cpuinfo)."""
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_flags() -> str:
    """One line: the CPU's model and which of FLAGS it has."""
    model, flags = cpu()
    return f"{model}; {' '.join(f for f in FLAGS if f in flags)}"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict:
    """CPU model, FLAGS present or not, cores, package versions (those installed), the commit."""
    model, flags = cpu()
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu_model": model, "cpu_flags": {f: f in flags for f in FLAGS}, "cores": os.cpu_count(),
            "versions": versions, "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}


def memory_bandwidth(mib: int = 512, repeat: int = 5) -> dict[str, float]:
    """This machine's memory bandwidth in GB/s, measured with torch's threads
    (as set by the caller) over buffers far past the caches, best of
    ``repeat``: "read" sums a float32 buffer of ``mib`` MiB (what a decode
    step does to its weights), "copy" copies one into another and counts
    both the bytes read and written."""
    import time

    import torch

    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    best = {"read": float("inf"), "copy": float("inf")}
    for _ in range(repeat):
        for kind, run in (("read", lambda: src.sum()), ("copy", lambda: dst.copy_(src))):
            t0 = time.perf_counter()
            run()
            best[kind] = min(best[kind], time.perf_counter() - t0)
    return {"read": n * 4 / best["read"] / 1e9, "copy": 2 * n * 4 / best["copy"] / 1e9}


def write_json(path: str | None, bench: str, args, rows: list[dict], **extra) -> None:
    """Write {"bench", "args", "machine", "rows", **extra} to ``path`` (nothing if None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"bench": bench, "args": vars(args), "machine": machine(), "rows": rows, **extra},
                      f, indent=1)
