"""Load time: LLM(path) in a fresh process, with the pack cache (model/pack_cache.py) off,
on a first start (an empty cache: pack, then write the entry on a thread of its own) and on
a second start (every matrix taken back), beside llama.cpp's Llama(path) where
llama-cpp-python is installed (make bench-setup).

    python benches/bench_load.py [--models default qwen2.5-coder-0.5b qwen2.5-coder-1.5b] [--repeat 3]

Each figure is the median of the repeats, the cases interleaved so that a slow spell of the
machine falls on all of them. "LLM()" is the constructor alone (the import is timed apart);
"process" is the process's whole life, which on a first start includes waiting at exit for
the entry to reach the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from machine import cpu_flags

_GUIDED = """
import json, sys, time
t0 = time.perf_counter()
from guided import LLM
t1 = time.perf_counter()
llm = LLM(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1}))
"""

_LLAMA = """
import json, sys, time
t0 = time.perf_counter()
import llama_cpp
t1 = time.perf_counter()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=2048, verbose=False)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1}))
"""


def model_path(name: str) -> str:
    if name == "default":
        from guided.model import default_model_path
        return str(default_model_path())
    if os.path.exists(name):
        return name
    from guided.models import fetch
    return fetch(name)


def run(code: str, path: str, env: dict[str, str]) -> dict[str, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, path], env={**os.environ, **env},
                         capture_output=True, text=True, check=True)
    taken = json.loads(out.stdout.strip().splitlines()[-1])
    return {**taken, "process": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["default", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print("CPU:", cpu_flags())
    try:
        import llama_cpp  # noqa: F401
        peer = True
    except ImportError:
        print("llama-cpp-python is not installed (make bench-setup): no llama.cpp rows")
        peer = False
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            path = model_path(name)
            warm = os.path.join(scratch, "warm")
            run(_GUIDED, path, {"GUIDED_CACHE": warm})   # the entry the second starts find; the file read once
            cases = {"guided, pack cache off": lambda: run(_GUIDED, path, {"GUIDED_PACK_CACHE": "off"}),
                     "guided, first start": lambda: run(_GUIDED, path, {"GUIDED_CACHE": tempfile.mkdtemp(dir=scratch)}),
                     "guided, second start": lambda: run(_GUIDED, path, {"GUIDED_CACHE": warm})}
            if peer:
                cases["llama.cpp"] = lambda: run(_LLAMA, path, {})
            taken: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
            for _ in range(args.repeat):
                for case, measure in cases.items():
                    taken[case].append(measure())
            for case, runs in taken.items():
                rows.append((os.path.basename(path), os.path.getsize(path) / 1e6, case,
                             *(statistics.median(r[k] for r in runs) for k in ("import", "load", "process"))))
    print(f"\nmedian of {args.repeat} fresh processes each\n")
    print(f"{'model':<42}{'MB':>7}  {'case':<26}{'import s':>9}{'LLM() s':>9}{'process s':>11}")
    for model, mb, case, imp, load, proc in rows:
        print(f"{model:<42}{mb:>7.0f}  {case:<26}{imp:>9.2f}{load:>9.2f}{proc:>11.2f}")
    print()
    for model in dict.fromkeys(r[0] for r in rows):
        by = {r[2]: r for r in rows if r[0] == model}
        line = f"{model}: second start {by['guided, pack cache off'][4] / by['guided, second start'][4]:.1f}x faster than no cache"
        if "llama.cpp" in by:
            line += f", {by['guided, second start'][4] / by['llama.cpp'][4]:.2f}x llama.cpp's load time"
        print(line)


if __name__ == "__main__":
    main()
