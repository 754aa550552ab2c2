"""Grammar mask time per decode step: guided's native core vs llguidance's
Python LLMatcher vs xgrammar, same grammars, tokenizers and token walks, one run.

    python benches/bench_masks.py [--tokenizers smollm2 deepseek] [--batches 1 16 64] [--json PATH]
    pytest benches/bench_masks.py --benchmark-only

Two grammars — a nested JSON Schema (objects, enums, arrays, numbers, strings)
and a Lark grammar (a small SQL dialect) — walked token by token along real
instances, so every mask is computed at a state a model would reach. Two
tokenizers, read from GGUF metadata only (no weights): SmolLM2 (49k, the
default model) and DeepSeek-R1-Distill-Qwen-7B (152k).

At batch B every row is a live matcher (rows walk one of several instances,
so their states differ); one step fills the whole ``[B, ceil(V/32)]`` mask:

- guided: a ``Scheduler`` with B grammar requests (fast-forward off, so every
  token goes through a mask) fed fake logits that pick the instance's next
  token; the step's mask time is the growth of ``stats()["mask_time_us"]``,
  i.e. the wall time of the batched Rust job (rows in parallel, GIL released)
  that ``start_masks()`` launches in the engine. ``guided Matcher`` (batch 1
  only) is the per-row ``Matcher.compute_mask`` call.
- llguidance: ``LLMatcher`` per row, ``fill_next_token_bitmask_par`` with an
  ``LLExecutor`` (``fill_next_token_bitmask`` at batch 1).
- xgrammar: ``GrammarMatcher`` per row, ``BatchGrammarMatcher
  .batch_fill_next_token_bitmask`` (``fill_next_token_bitmask`` at batch 1).

guided and llguidance compile the very same llguidance grammar text (the
engine's composer output: sanitised schema, bounded whitespace); xgrammar
compiles the same schema with ``compile_json_schema`` and the same Lark text
with ``compile_lark``. Reported: per-step p50/p99 (µs) and, per row, p50/B.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
for p in (_HERE.parent / "python", _HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from jsonschemabench import encode, load_tokenizer  # noqa: E402
from machine import write_json  # noqa: E402

# ----------------------------------------------------------------------------- grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ord-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "created": {"type": "string", "format": "date-time"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "email": {"type": "string", "format": "email"},
                "tier": {"enum": ["free", "silver", "gold"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "country": {"enum": ["FR", "DE", "US", "GB", "JP"]},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "email", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number", "minimum": 0},
        "gift": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "status", "customer", "items", "total"],
    "additionalProperties": False,
}


def _order(i: int) -> dict:
    names = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Katherine Johnson"]
    cities = [("12 Rue de la Paix", "Paris", "75002", "FR"), ("1 Main St", "Springfield", "62701", "US"),
              ("Unter den Linden 5", "Berlin", "10117", "DE"), ("221B Baker St", "London", "", "GB")]
    street, city, zip_, country = cities[i % 4]
    address = {"street": street, "city": city, **({"zip": zip_} if zip_ else {}), "country": country}
    items = [{"sku": f"SKU-{100 + 7 * k + i}", "quantity": 1 + (k + i) % 4,
              "price": round(9.99 + 3.5 * k + i, 2), "tags": ["new", "sale"][: (k + i) % 3]}
             for k in range(2 + i % 3)]
    return {"id": f"ord-{123456 + i:06d}", "status": ["paid", "shipped", "pending", "delivered"][i % 4],
            "created": f"2024-0{1 + i % 9}-1{i % 9}T10:2{i % 6}:00Z",
            "customer": {"name": names[i % 4], "email": f"{names[i % 4].split()[0].lower()}@example.com",
                         "tier": ["gold", "free", "silver", "gold"][i % 4], "address": address},
            "items": items, "total": round(sum(x["price"] * x["quantity"] for x in items), 2),
            "gift": i % 2 == 0, "note": None if i % 2 else "leave at the door"}


LARK = r"""
start: stmt (";" stmt)* ";"
stmt: "SELECT " cols " FROM " NAME where? order? limit?
cols: col (", " col)*
col: NAME | NAME "." NAME | FUNC "(" NAME ")"
FUNC: "COUNT" | "SUM" | "AVG" | "MAX" | "MIN"
where: " WHERE " cond (" AND " cond)*
cond: NAME OP value
OP: " = " | " < " | " > " | " <= " | " >= " | " != "
value: NUMBER | STRING
order: " ORDER BY " NAME DIR?
DIR: " ASC" | " DESC"
limit: " LIMIT " NUMBER
NAME: /[a-z_][a-z0-9_]*/
NUMBER: /[0-9]+(\.[0-9]+)?/
STRING: /'[^']*'/
"""


def _sql(i: int) -> str:
    t = ["users", "orders", "products", "events"]
    return ";".join([
        f"SELECT name, COUNT(id), {t[i % 4]}.created_at FROM {t[i % 4]} WHERE age >= {18 + i} "
        f"AND city = 'Paris' AND score < {i}.5 ORDER BY name DESC LIMIT {10 * (i + 1)}",
        f"SELECT SUM(amount), customer_id FROM {t[(i + 1) % 4]} WHERE status != 'cancelled' "
        f"ORDER BY customer_id",
        f"SELECT MAX(price) FROM {t[(i + 2) % 4]} LIMIT {i + 3}",
    ]) + ";"


N_INSTANCES = 4
GRAMMARS = {
    "json": ({"json": SCHEMA}, [json.dumps(_order(i), separators=(",", ":")) for i in range(N_INSTANCES)]),
    "lark": ({"grammar": LARK}, [_sql(i) for i in range(N_INSTANCES)]),
}


# ----------------------------------------------------------------------------- setup

class Setup:
    """One tokenizer: guided's compiler, llguidance's and xgrammar's tokenizers."""

    def __init__(self, name: str):
        import llguidance
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        from guided._native import GrammarCompiler
        from guided.tokenizer import plain_encoder, token_bytes

        self.name = name
        self.tok, self.end_ids, self.vocab = load_tokenizer(name)
        self.guided = GrammarCompiler(token_bytes(self.tok), list(self.end_ids), self.vocab,
                                      tokenize=plain_encoder(self.tok))
        self.llg_tok = llguidance.LLTokenizer(self.tok.to_str(), n_vocab=self.vocab,
                                              eos_token=list(self.end_ids))
        self.llg_exec = llguidance.LLExecutor()
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=self.tok),
                                                  vocab_size=self.vocab, stop_token_ids=list(self.end_ids))
        self.xgr = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
        self.compiled: dict = {}

    def grammar(self, kind: str):
        """(guided Grammar, llguidance grammar text, xgrammar CompiledGrammar, token walks)."""
        if kind not in self.compiled:
            from guided.grammar import compose
            so, texts = GRAMMARS[kind]
            text = compose(so).text
            g = self.guided.compile(text)
            xg = (self.xgr.compile_json_schema(json.dumps(SCHEMA)) if kind == "json"
                  else self.xgr.compile_lark(LARK))
            walks = [encode(self.tok, t) for t in texts]
            self.compiled[kind] = (g, text, xg, walks)
        return self.compiled[kind]


@lru_cache(maxsize=None)
def setup(name: str) -> Setup:
    return Setup(name)


# ----------------------------------------------------------------------------- one walk per engine
# Each returns the per-step mask times (µs) of a batch of `batch` rows, row r
# walking instance r % N_INSTANCES, for the steps where every row is live.

def walk_guided_scheduler(s: Setup, kind: str, batch: int) -> list[float]:
    from guided import SamplingParams
    from guided._native import Scheduler
    g, _, _, walks = s.grammar(kind)
    rows = [walks[r % len(walks)] for r in range(batch)]
    steps = min(len(w) for w in rows)
    longest = max(len(w) for w in rows)
    sched = Scheduler(num_blocks=batch * ((longest + 40) // 16 + 2), block_size=16, max_num_seqs=batch,
                      max_num_batched_tokens=max(2048, batch), max_model_len=longest + 64,
                      eos_token_ids=list(s.end_ids), enable_prefix_caching=False)
    for r in range(batch):
        sched.add_request(r, [1], SamplingParams(max_tokens=longest + 8, fast_forward=False), g)
    pos = [0] * batch
    times = []
    logits = np.zeros((batch, s.vocab), dtype=np.float32)
    while sched.has_unfinished():
        plan = sched.schedule()
        if plan is None:
            break
        if len(plan.logits_indices) == 0:
            sched.update(np.zeros(0, dtype=np.int64))
            continue
        sids = plan.sample_seq_ids.tolist()
        before = sched.stats()["mask_time_us"]
        sched.start_masks()  # the engine's call; here nothing runs beside it
        lg = logits[: len(sids)]
        picks = []
        for i, sid in enumerate(sids):
            w = rows[sid]
            t = w[pos[sid]] if pos[sid] < len(w) else s.end_ids[0]
            lg[i, t] = 1.0
            picks.append(t)
        toks, _, _ = sched.sample(lg)
        for i, t in enumerate(picks):
            lg[i, t] = 0.0
        dt = sched.stats()["mask_time_us"] - before
        if len(sids) == batch and all(pos[sid] < steps for sid in sids):
            times.append(float(dt))
        if not np.array_equal(toks, np.array(picks)):
            raise RuntimeError(f"guided rejected the {kind} instance at {pos}: {toks} vs {picks}")
        for ev in sched.update(toks):
            if ev.finish_reason == "error":
                raise RuntimeError(f"guided: {ev.error}")
        for sid in sids:
            pos[sid] += 1
    return times


def walk_guided_matcher(s: Setup, kind: str, batch: int) -> list[float]:
    g, _, _, walks = s.grammar(kind)
    rows = [walks[r % len(walks)] for r in range(batch)]
    ms = [g.matcher() for _ in rows]
    times = []
    for k in range(min(len(w) for w in rows)):
        t0 = time.perf_counter()
        for m in ms:
            m.compute_mask()
        times.append((time.perf_counter() - t0) * 1e6)
        for m, w in zip(ms, rows):
            if not m.consume_token(w[k]):
                raise RuntimeError(f"guided Matcher: {m.error()}")
    return times


def walk_llguidance(s: Setup, kind: str, batch: int) -> list[float]:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par
    _, text, _, walks = s.grammar(kind)
    rows = [walks[r % len(walks)] for r in range(batch)]
    proto = llguidance.LLMatcher(s.llg_tok, text, log_level=0)
    if proto.is_error():
        raise RuntimeError(proto.get_error())
    ms = [proto.deep_copy() for _ in rows]
    bitmask = allocate_token_bitmask(batch, s.vocab)
    pairs = [(m, i) for i, m in enumerate(ms)]
    times = []
    for k in range(min(len(w) for w in rows)):
        t0 = time.perf_counter()
        if batch == 1:
            fill_next_token_bitmask(ms[0], bitmask, 0)
        else:
            fill_next_token_bitmask_par(s.llg_exec, pairs, bitmask)
        times.append((time.perf_counter() - t0) * 1e6)
        for m, w in zip(ms, rows):
            if not m.consume_token(w[k]):
                raise RuntimeError(f"llguidance: {m.get_error()}")
    return times


def walk_xgrammar(s: Setup, kind: str, batch: int) -> list[float]:
    import xgrammar as xgr
    _, _, cg, walks = s.grammar(kind)
    rows = [walks[r % len(walks)] for r in range(batch)]
    ms = [xgr.GrammarMatcher(cg) for _ in rows]
    bm = xgr.allocate_token_bitmask(batch, s.vocab)
    bmat = xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)
    times = []
    for k in range(min(len(w) for w in rows)):
        t0 = time.perf_counter()
        if batch == 1:
            ms[0].fill_next_token_bitmask(bm, 0)
        else:
            bmat.batch_fill_next_token_bitmask(ms, bm)
        times.append((time.perf_counter() - t0) * 1e6)
        for m, w in zip(ms, rows):
            if not m.accept_token(w[k]):
                raise RuntimeError(f"xgrammar rejected token {k} of the {kind} instance")
    return times


ENGINES = {
    "guided": walk_guided_scheduler,
    "guided Matcher": walk_guided_matcher,
    "llguidance": walk_llguidance,
    "xgrammar": walk_xgrammar,
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(np.ceil(q / 100 * len(xs))) - 1))]


# ----------------------------------------------------------------------------- pytest-benchmark
try:
    import pytest
except ImportError:  # script mode without pytest
    pytest = None

if pytest is not None:
    _CASES = [(t, k, b) for t in ("smollm2", "deepseek") for k in GRAMMARS for b in (1, 16, 64)]
    _IDS = [f"{t}-{k}-b{b}" for t, k, b in _CASES]

    @pytest.mark.parametrize("engine", [e for e in ENGINES if e != "guided Matcher"])
    @pytest.mark.parametrize("tokenizer,kind,batch", _CASES, ids=_IDS)
    def test_mask_walk(benchmark, engine, tokenizer, kind, batch):
        """One whole walk (every step's batched mask plus the commits)."""
        s = setup(tokenizer)
        s.grammar(kind)
        times = benchmark.pedantic(ENGINES[engine], args=(s, kind, batch), rounds=3, iterations=1,
                                   warmup_rounds=1)
        benchmark.extra_info.update(step_us_p50=statistics.median(times), step_us_p99=pct(times, 99),
                                    steps=len(times))


# ----------------------------------------------------------------------------- script

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizers", nargs="+", default=["smollm2", "deepseek"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--grammars", nargs="+", default=list(GRAMMARS))
    ap.add_argument("--repeat", type=int, default=3, help="walks per cell (times pooled)")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine here")
    args = ap.parse_args()
    rows = []
    for tname in args.tokenizers:
        t0 = time.perf_counter()
        s = setup(tname)
        print(f"{tname}: vocab {s.vocab}, set up in {time.perf_counter() - t0:.1f} s", flush=True)
        for kind in args.grammars:
            walks = s.grammar(kind)[3]
            print(f"  {kind}: instances of {[len(w) for w in walks]} tokens", flush=True)
            for batch in args.batches:
                for ename, fn in ENGINES.items():
                    if ename == "guided Matcher" and batch != 1:
                        continue
                    fn(s, kind, batch)  # warm-up
                    times = [t for _ in range(args.repeat) for t in fn(s, kind, batch)]
                    p50 = statistics.median(times)
                    rows.append({"tokenizer": tname, "vocab": s.vocab, "grammar": kind, "batch": batch,
                                 "engine": ename, "step_us_p50": p50, "step_us_p99": pct(times, 99),
                                 "row_us_p50": p50 / batch, "steps": len(times)})
    print(f"\nmask time per decode step (whole [batch, vocab/32] mask), µs; {os.cpu_count()} CPUs; "
          f"per row = p50 / batch\n")
    print(f"{'tokenizer':<10}{'vocab':>8}{'grammar':>8}{'batch':>6}  {'engine':<16}"
          f"{'p50':>9}{'p99':>9}{'per row':>9}{'steps':>7}")
    for r in rows:
        print(f"{r['tokenizer']:<10}{r['vocab']:>8}{r['grammar']:>8}{r['batch']:>6}  {r['engine']:<16}"
              f"{r['step_us_p50']:>9.1f}{r['step_us_p99']:>9.1f}{r['row_us_p50']:>9.1f}{r['steps']:>7}")
    print("\nratios (other / guided; > 1 means guided is faster)\n")
    print(f"{'tokenizer':<10}{'grammar':>8}{'batch':>6}  {'llg p50':>8}{'llg p99':>8}{'xgr p50':>8}{'xgr p99':>8}")
    for tname in args.tokenizers:
        for kind in args.grammars:
            for batch in args.batches:
                cell = {r["engine"]: r for r in rows
                        if (r["tokenizer"], r["grammar"], r["batch"]) == (tname, kind, batch)}
                g = cell["guided"]
                ratio = [f"{cell[e][k] / max(g[k], 1e-9):>8.2f}" for e in ("llguidance", "xgrammar")
                         for k in ("step_us_p50", "step_us_p99")]
                print(f"{tname:<10}{kind:>8}{batch:>6}  " + "".join(ratio))
    write_json(args.json, "bench_masks", args, rows)


if __name__ == "__main__":
    main()
