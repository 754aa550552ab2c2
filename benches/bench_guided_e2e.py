"""End-to-end guided decoding on the default model, one run:

    python benches/bench_guided_e2e.py [--batch 16] [--hf-batch 16] [--new-tokens 128]
                                       [--skip-hf] [--skip-fp32] [--masks auto,overlap]
                                       [--json PATH]

(a) guided, constrained (a JSON schema) vs unconstrained, same prompts,
    greedy. The constrained run ends where its JSON ends (or at
    --new-tokens); the unconstrained run then gets exactly those output
    lengths (max_tokens = each row's constrained length, ignore_eos), so both
    produce the same number of tokens. Throughput = generated tokens / wall
    time of the whole generate() call (prefill included, identical prompts).
    The four runs (constrained, free, fast-forward off, cut) are interleaved, each
    --repeat times in turn (rotated each round), best of each. Printed: the ratio constrained/unconstrained
    (floor 0.90, goal 0.97: per round, the constrained run over the free one of that round, the
    median over rounds, as the other ratios; on a noisy machine best-of-each mixes spells), the
    same for on_length="cut" (no closing at the budget; its cost shows as the
    difference, clearest with a small --new-tokens that cuts every row) and
    the engine's counters over the constrained run: forced_tokens,
    mask_time_us, mask_wait_us (the part sample() waited for; the rest was
    hidden behind the forward pass); and the host's time in the scheduler:
    add_request per constrained request (its grammar seen before: the
    warm-up compiled it and ran its first closing search) and update() per
    step, constrained and free.
(b) constrained throughput vs transformers ``generate`` (fp32, GGUF loaded
    with gguf_file=) with xgrammar's ``xgrammar.contrib.hf.LogitsProcessor``
    and with a llguidance logits processor (llguidance ships no HF processor:
    a minimal one over its ``LLMatcher`` + ``fill_next_token_bitmask_par`` +
    ``apply_token_bitmask_inplace``), same schema and prompt tokens, greedy.
    transformers counts each row's new tokens up to and including its end
    token.

guided runs in its default dtype (fp32 activations, bf16 weights on this CPU)
and with dtype="float32" (the same dtype as transformers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from guided import LLM, SamplingParams
from guided.model import default_model_path

from machine import write_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"enum": ["engineer", "teacher", "doctor", "artist", "farmer", "other"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "married": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "skills", "married"],
    "additionalProperties": False,
}
PEOPLE = ["a baker from Lyon", "a retired sailor", "a young software engineer", "a farmer in Kansas",
          "a painter in Kyoto", "a nurse from Lagos", "a teacher in Oslo", "a chess champion",
          "a doctor in Lima", "a violin maker", "a pilot from Cairo", "a student in Seoul",
          "a librarian in Prague", "a chef from Naples", "a miner in Chile", "a poet in Dublin"]


def prompt_ids(tok, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        msg = (f"Describe {PEOPLE[i % len(PEOPLE)]} as a JSON object with the keys name, age, city, "
               f"occupation, skills and married. Answer with JSON only.")
        ids = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def dtype_label(llm: LLM) -> str:
    act, weight = (str(d).removeprefix("torch.") for d in (llm.loaded.dtype, llm.loaded.weight_dtype))
    return act if act == weight else f"{act}, {weight} weights"


def timed(fn, repeat: int):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


# ----------------------------------------------------------------------------- (a)

def run_guided(llm: LLM, prompts, new_tokens: int, repeat: int):
    so = {"json": SCHEMA}
    # Warm-up at full size: the first batch of this shape pays for allocations (KV pool
    # pages, buffers) that would otherwise land on whichever run is timed first. Its
    # (greedy, so repeated) output lengths are what free decoding then generates.
    warm = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, structured_outputs=so))
    lens = [len(o.token_ids) for o in warm]
    keys = ("forced_tokens", "mask_time_us", "mask_wait_us", "mask_rows", "steps")
    delta = dict.fromkeys(keys, 0)

    def constrained():
        before = {k: llm.stats()[k] for k in keys}
        out = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, structured_outputs=so))
        for k in keys:
            delta[k] += llm.stats()[k] - before[k]
        return out

    # The runs interleaved, each repeat once in turn, best of each: a slow spell of the
    # machine then falls on every kind alike. "cut": without closing at the budget
    # (on_length="cut"), its outputs may be shorter, so it is compared per token.
    host = {name: dict.fromkeys(("add_request_us", "update_us", "steps"), 0) for name in ("con", "free")}

    def counted(name, fn):
        """``fn`` with the engine's host time (add_request, update) counted for ``name``."""
        def run():
            before = llm.stats()
            out = fn()
            for k, v in host[name].items():
                host[name][k] = v + llm.stats().get(k, 0) - before.get(k, 0)
            return out
        return run

    runs = {
        "con": counted("con", constrained),
        "free": lambda: llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                               for n in lens]),
        "ff": lambda: llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                           structured_outputs=so, fast_forward=False)),
        "cut": lambda: llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                            structured_outputs={**so, "on_length": "cut"})),
    }
    runs["free"] = counted("free", runs["free"])
    best, out, rounds = interleaved(runs, repeat)
    outs, free, cut = out["con"], out["free"], out["cut"]
    assert [len(o.token_ids) for o in outs] == lens and [len(o.token_ids) for o in free] == lens
    valid = sum(map(_parses, (o.text for o in outs)))
    n_cut = sum(len(o.token_ids) for o in cut)
    n = sum(lens)
    return {"tokens": n, "valid_json": valid, "finish": [o.finish_reason for o in outs],
            "con_tps": n / best["con"], "ff_off_tps": n / best["ff"], "free_tps": n / best["free"],
            "cut_tps": n_cut / best["cut"], "cut_valid": sum(map(_parses, (o.text for o in cut))),
            # per round, each kind over the free run of the same round (tok/s), the median:
            # a slow spell falls on both runs of a pair, where best-of-each mixes spells
            **{f"{k}_over_free": statistics.median(r["free"] / r[k] * (n_cut if k == "cut" else n) / n
                                                   for r in rounds) for k in ("con", "ff", "cut")},
            **{k: v // repeat for k, v in delta.items()}, "sample_text": outs[0].text,
            "add_request_ms": host["con"]["add_request_us"] / 1e3 / (repeat * len(prompts)),
            "update_ms": host["con"]["update_us"] / 1e3 / max(1, host["con"]["steps"]),
            "free_update_ms": host["free"]["update_us"] / 1e3 / max(1, host["free"]["steps"])}


def interleaved(runs: dict, repeat: int) -> tuple[dict, dict, list[dict]]:
    """Best wall time of each run over ``repeat`` rounds of all of them in turn (each round
    starts one run later, so no run always follows the same one), each run's last result,
    and each round's wall times."""
    best, out, rounds = dict.fromkeys(runs, float("inf")), {}, []
    names = list(runs)
    for r in range(repeat):
        rounds.append({})
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = runs[name]
            t0 = time.perf_counter()
            out[name] = fn()
            rounds[-1][name] = time.perf_counter() - t0
            best[name] = min(best[name], rounds[-1][name])
    return best, out, rounds


def a_row(label: str, batch: int, r: dict) -> dict:
    """(a)'s printed row for one dtype, units in the keys; ratios are to free decoding."""
    hidden = 1 - r["mask_wait_us"] / r["mask_time_us"] if r["mask_time_us"] else float("nan")
    return {"part": "a", "engine": "guided", "dtype": label, "batch": batch, "tokens": r["tokens"],
            "valid_json": r["valid_json"], "constrained_tok_s": r["con_tps"], "ff_off_tok_s": r["ff_off_tps"],
            "free_tok_s": r["free_tps"], "constrained_over_free": r["con_over_free"],
            "ff_off_over_free": r["ff_over_free"], "forced_tokens": r["forced_tokens"],
            "mask_ms": r["mask_time_us"] / 1e3, "mask_waited_ms": r["mask_wait_us"] / 1e3,
            "mask_hidden_pct": 100 * hidden, "cut_tok_s": r["cut_tps"],
            "cut_over_free": r["cut_over_free"], "cut_valid_json": r["cut_valid"],
            "finish_reasons": {f: r["finish"].count(f) for f in set(r["finish"])},
            "add_request_ms": r["add_request_ms"], "update_ms_per_step": r["update_ms"],
            "free_update_ms_per_step": r["free_update_ms"]}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------- (b)

class LLGuidanceLogitsProcessor:
    """One llguidance LLMatcher per row; masks filled in parallel by LLExecutor."""

    def __init__(self, hf_tok, grammar: str, vocab: int, eos_ids: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
        self.lt = lt
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=vocab, eos_token=eos_ids)
        self.grammar = grammar
        self.exec = llguidance.LLExecutor()
        self.vocab = vocab
        self.matchers = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.matchers is None:
            proto = self.llg.LLMatcher(self.tok, self.grammar, log_level=0)
            self.matchers = [proto.deep_copy() for _ in range(input_ids.shape[0])]
            self.bitmask = self.lt.allocate_token_bitmask(input_ids.shape[0], self.vocab)
        else:
            for m, t in zip(self.matchers, input_ids[:, -1].tolist()):
                if not m.is_stopped():
                    m.consume_token(t)
        self.lt.fill_next_token_bitmask_par(self.exec, [(m, i) for i, m in enumerate(self.matchers)],
                                            self.bitmask)
        self.lt.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device))
        return scores


def run_hf(hf, tok, prompts, new_tokens: int, repeat: int, make_processor):
    import transformers
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])

    def gen():
        proc = transformers.LogitsProcessorList([make_processor()])
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=attn, max_new_tokens=new_tokens, do_sample=False,
                               logits_processor=proc, pad_token_id=pad)

    gen()  # warm-up
    t, out = timed(gen, repeat)
    n, texts = 0, []
    for row in out[:, width:].tolist():
        k = next((i + 1 for i, x in enumerate(row) if x in eos), len(row))
        n += k
        texts.append(tok.decode(row[:k], skip_special_tokens=True))
    valid = 0
    for text in texts:
        try:
            json.loads(text)
            valid += 1
        except ValueError:
            pass
    return {"tokens": n, "tps": n / t, "valid_json": valid, "sample_text": texts[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-fp32", action="store_true", help="only the default dtype in (a)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--masks", default="auto",
                    help="comma-separated mask policies of the default engine, a row each "
                         "(auto, overlap, on_demand: LLM(masks=...))")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    path = Path(default_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = prompt_ids(tok, max(args.batch, args.hf_batch))

    engines = {}
    policies = args.masks.split(",")
    for masks in policies:
        default = LLM(enable_prefix_caching=False, max_num_seqs=args.batch, masks=masks)
        label = f"default ({dtype_label(default)})"
        engines[label if len(policies) == 1 else f"{label} masks={masks}"] = default
    if not args.skip_fp32:
        engines["float32"] = LLM(dtype="float32", enable_prefix_caching=False, max_num_seqs=args.batch)

    print(f"\nSmolLM2-135M-Instruct Q4_1, CPU, {torch.get_num_threads()} threads, greedy, "
          f"<= {args.new_tokens} new tokens, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens\n", flush=True)
    a_rows = {}
    for label, llm in engines.items():
        a_rows[label] = run_guided(llm, prompts[: args.batch], args.new_tokens, args.repeat)
    w = max(map(len, engines)) + 2
    print(f"(a) guided, batch {args.batch}, JSON schema vs free decoding of the same lengths\n")
    print(f"{'dtype':<{w}}{'tokens':>7}{'valid':>6}{'constr tok/s':>13}{'ff-off tok/s':>13}"
          f"{'free tok/s':>11}{'ratio':>7}{'ff-off':>7}{'forced':>7}{'mask ms':>9}{'waited ms':>10}"
          f"{'hidden':>7}{'cut tok/s':>10}{'cut':>6}{'valid':>6}")
    rows = [a_row(label, args.batch, r) for label, r in a_rows.items()]
    for r in rows:
        print(f"{r['dtype']:<{w}}{r['tokens']:>7}{r['valid_json']:>6}{r['constrained_tok_s']:>13.1f}"
              f"{r['ff_off_tok_s']:>13.1f}{r['free_tok_s']:>11.1f}{r['constrained_over_free']:>7.3f}"
              f"{r['ff_off_over_free']:>7.3f}{r['forced_tokens']:>7}{r['mask_ms']:>9.1f}"
              f"{r['mask_waited_ms']:>10.1f}{r['mask_hidden_pct']:>6.0f}%{r['cut_tok_s']:>10.1f}"
              f"{r['cut_over_free']:>6.3f}{r['cut_valid_json']:>6}")
    for r in rows:
        print(f"{r['dtype']}: add_request {r['add_request_ms']:.2f} ms a constrained request "
              f"(warm: the grammar seen before); update() {r['update_ms_per_step']:.2f} ms a step "
              f"constrained, {r['free_update_ms_per_step']:.2f} free")
    first = next(iter(a_rows.values()))
    print(f"\nfinish reasons: {rows[0]['finish_reasons']}; "
          f"row 0: {first['sample_text'][:160]!r}")
    print("tok/s: best of each kind; ratio = constrained / free tok/s, the median over rounds of "
          "the runs of one round (floor 0.90, goal 0.97); ff-off = constrained with "
          "fast_forward=False / free; mask ms = wall time of the mask jobs, waited = what sample() "
          "waited for, hidden = the share that overlapped the forward pass; cut = constrained with "
          "on_length='cut' (no closing at the budget) / free, and how many of its outputs parse\n",
          flush=True)
    write_json(args.json, "bench_guided_e2e", args, rows)  # (a) kept should (b) fail
    if args.skip_hf:
        return

    del default
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    eos = hf.generation_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]

    import xgrammar as xgr
    import xgrammar.contrib.hf as xhf
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos_ids)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    from guided.grammar import compose
    llg_grammar = compose({"json": SCHEMA}).text  # the very grammar guided compiles
    hp = prompts[: args.hf_batch]
    b_rows = {
        "transformers + xgrammar": run_hf(hf, tok, hp, args.new_tokens, args.repeat,
                                          lambda: xhf.LogitsProcessor(compiled)),
        "transformers + llguidance": run_hf(hf, tok, hp, args.new_tokens, args.repeat,
                                            lambda: LLGuidanceLogitsProcessor(tok, llg_grammar, vocab,
                                                                              eos_ids)),
    }
    if args.hf_batch != args.batch:  # guided at the same batch as transformers
        for label, llm in engines.items():
            r = run_guided(llm, hp, args.new_tokens, 1)
            a_rows[label] = r
    print(f"(b) constrained decoding, batch {args.hf_batch}, same schema and prompt tokens, greedy\n")
    w2 = max(len(k) for k in [*b_rows, *(f"guided {k}" for k in a_rows)]) + 2
    print(f"{'engine':<{w2}}{'dtype':<10}{'tokens':>7}{'valid':>6}{'tok/s':>9}")
    for label, r in a_rows.items():
        print(f"{'guided ' + label.split(' ')[0]:<{w2}}{'see (a)':<10}{r['tokens']:>7}{r['valid_json']:>6}"
              f"{r['con_tps']:>9.1f}")
    for label, r in b_rows.items():
        print(f"{label:<{w2}}{'float32':<10}{r['tokens']:>7}{r['valid_json']:>6}{r['tps']:>9.1f}")
    print()
    for label, r in a_rows.items():
        for blabel, b in b_rows.items():
            print(f"guided {label} vs {blabel}: {r['con_tps'] / b['tps']:.2f}x tok/s")
    print(f"\ntransformers + xgrammar row 0: {b_rows['transformers + xgrammar']['sample_text'][:160]!r}")
    b_table = [("guided", label, r, r["con_tps"]) for label, r in a_rows.items()]
    b_table += [(label, "float32", r, r["tps"]) for label, r in b_rows.items()]
    rows += [{"part": "b", "engine": engine, "dtype": dtype, "batch": args.hf_batch, "tokens": r["tokens"],
              "valid_json": r["valid_json"], "constrained_tok_s": tps} for engine, dtype, r, tps in b_table]
    write_json(args.json, "bench_guided_e2e", args, rows)


if __name__ == "__main__":
    main()
