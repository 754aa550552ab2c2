"""The comparison benches at their default sizes, written up as one report.

    python benches/report.py [--out bench-report] [--from DIR]

Runs, each as its own process writing --json into OUT/data/ (output also in
OUT/data/NAME.log): bench_generate (decode tok/s and prefill by batch: guided
vs transformers vs llama.cpp), bench_guided_e2e at batch 1 and 8 without
transformers and at batch 16 with it (constrained ÷ free by batch; at 16 also
vs transformers + xgrammar / llguidance), bench_serve (the HTTP server under
concurrent streaming clients vs a transformers + xgrammar server) and
bench_masks (mask time per step vs llguidance and xgrammar). A bench that
fails is recorded (its exit status and last lines of output) and the next one
runs. After each bench, OUT/README.md is rewritten: the machine, one table per
bench and these plots beside it (PNG): decode.png, e2e_ratio.png,
serve_throughput.png, serve_latency.png, masks.png.

--from DIR rebuilds the report from the JSON files in DIR (an earlier
OUT/data) without running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: name: (script, arguments besides --json). Default sizes everywhere.
RUNS = {
    "generate": ("bench_generate.py", []),
    **{f"e2e_b{b}": ("bench_guided_e2e.py", ["--batch", str(b), "--skip-hf"]) for b in (1, 8)},
    "e2e_hf": ("bench_guided_e2e.py", ["--batch", "16"]),   # its part (a) is batch 16's ratio
    "masks": ("bench_masks.py", []),
    "serve": ("bench_serve.py", []),   # the longest (its peer serves one request at a time): last
}
TAIL = 25  # lines of a failed bench's output kept in the report


# ----------------------------------------------------------------------------- running

def run(name: str, data: Path) -> None:
    """One bench, its output to the console and NAME.log; NAME.json gains the
    command and wall time, and on failure the exit status and the log's tail."""
    script, extra = RUNS[name]
    path, log_path = data / f"{name}.json", data / f"{name}.log"
    cmd = [sys.executable, str(HERE / script), *extra, "--json", str(path)]
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    began = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TQDM_DISABLE": "1"}) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
    doc = json.loads(path.read_text()) if path.exists() else {"bench": Path(script).stem, "rows": []}
    doc.update(name=name, command=" ".join([f"benches/{script}", *extra]), wall_s=time.perf_counter() - began)
    if proc.returncode != 0 or not path.exists():
        tail = log_path.read_text().splitlines()[-TAIL:]
        doc["error"] = f"exit status {proc.returncode}\n" + "\n".join(tail)
    path.write_text(json.dumps(doc, indent=1))
    print(f"=== {name}: {'failed' if 'error' in doc else 'done'} in {doc['wall_s']:.0f} s", flush=True)


# ----------------------------------------------------------------------------- markdown

def fmt(value, spec: str = "") -> str:
    if value is None:
        return "–"
    return format(value, spec) if spec and isinstance(value, (int, float)) else str(value)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def table(rows: list[dict], cols: list[tuple]) -> list[str]:
    """A markdown table; cols are (header, key or function of the row, format spec)."""
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = (fmt(key(r) if callable(key) else r.get(key), spec) for _, key, spec in cols)
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def machine_section(docs: list[dict]) -> list[str]:
    m = next((d["machine"] for d in docs if "machine" in d), None)
    if m is None:
        return ["No bench wrote its machine (all failed before the end).", ""]
    flags = m["cpu_flags"]
    has = " ".join(f for f, on in flags.items() if on) or "none"
    lacks = " ".join(f for f, on in flags.items() if not on) or "none"
    commits = {(d["machine"]["commit"], d["machine"]["dirty"]) for d in docs if "machine" in d}
    commit = ", ".join(f"`{c}`" + (" with uncommitted changes" if dirty else "") for c, dirty in commits)
    rows = [("CPU", f"{m['cpu_model']}, {m['cores']} cores"), ("CPU flags", f"has {has}; lacks {lacks}"),
            ("commit", commit), *((name, v) for name, v in m["versions"].items())]
    return ["## Machine", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


# ----------------------------------------------------------------------------- plots

_COLORS: dict[str, str] = {}


def color(series: str) -> str:
    """One colour per series name, the same in every panel of a figure."""
    return _COLORS.setdefault(series, f"C{len(_COLORS) % 10}")


def lines(ax, rows: list[dict], x: str, y: str, series, style: str = "-", legend: bool = True) -> None:
    """One line of y against x per series(row), in the series' colour."""
    points = defaultdict(list)
    for r in rows:
        if r.get(y) is not None:
            points[series(r)].append((r[x], r[y]))
    for name, pts in points.items():
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, style, marker="o" if style == "-" else "^", color=color(name),
                label=name if legend else "_nolegend_")


def p50_p99(ax, rows: list[dict], x: str, y: str, series) -> None:
    """y.format(50) solid and y.format(99) dashed per series, and a key to the two styles."""
    lines(ax, rows, x, y.format(50), series)
    lines(ax, rows, x, y.format(99), series, "--", legend=False)
    ax.plot([], [], "k-o", label="p50 (solid)")
    ax.plot([], [], "k--^", label="p99 (dashed)")


def finish(ax, title: str, xlabel: str, ylabel: str, xs, logy: bool = False) -> None:
    """Title, axis labels, the x values as ticks (log2 scale), legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(xs)), [str(v) for v in sorted(set(xs))])
    ax.minorticks_off()
    if logy:
        from matplotlib.ticker import FuncFormatter, LogFormatter
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def figure(out: Path, name: str, title: str, draw, panels: int = 1, shape: tuple[int, int] | None = None):
    """Draw into a figure of `panels` axes, save out/name.png; the markdown that shows it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    _COLORS.clear()
    nrows, ncols = shape or (1, panels)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 4.6 * nrows), squeeze=False)
    draw(*axes.flat)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    plt.close(fig)
    return [f"![{title}]({name}.png)", ""]


# ----------------------------------------------------------------------------- one section per bench

def generate_section(docs: list[dict], out: Path) -> list[str]:
    d = docs[0]
    rows, a = d["rows"], d["args"]
    hf = {r["batch"]: r for r in rows if r["engine"] == "transformers"}
    md = [f"{a['new_tokens']} new tokens, prompt {d['prompt_tokens']} tokens, {d['threads']} threads, "
          f"greedy, end tokens ignored; best of {a['repeat']}. Prefill = time to the first token; "
          f"decode = batch × (new tokens − 1) / (time for all − time for one). Peak RSS with every "
          f"engine loaded {d['peak_rss_mb']:.0f} MB; guided's weights: "
          + ", ".join(f"{k} {v:.0f} MB" for k, v in d["weights_mb"].items()) + ".", ""]
    md += table(rows, [("engine", "engine", ""), ("dtype", "dtype", ""), ("batch", "batch", "d"),
                       ("prefill ms", "prefill_ms", ".1f"), ("decode tok/s", "decode_tok_s", ".1f"),
                       ("decode ÷ transformers", lambda r: r["decode_tok_s"] / hf[r["batch"]]["decode_tok_s"]
                        if r["batch"] in hf else None, ".2f")])

    def draw(dec, pre):
        label = lambda r: f"{r['engine']} {r['dtype']}"  # noqa: E731
        lines(dec, rows, "batch", "decode_tok_s", label)
        lines(pre, rows, "batch", "prefill_ms", label)
        xs = [r["batch"] for r in rows]
        finish(dec, "Decode throughput", "batch size (sequences)", "decode tokens/s (all sequences)", xs)
        finish(pre, "Prefill (time to first token)", "batch size (sequences)", "prefill ms", xs)
    return md + figure(out, "decode", f"SmolLM2-135M on CPU, {a['new_tokens']} new tokens", draw, 2)


def e2e_section(docs: list[dict], out: Path) -> list[str]:
    a_rows = {}  # (dtype, batch): row, from the --skip-hf runs where there are both
    for d in sorted(docs, key=lambda d: d["args"]["skip_hf"]):
        a_rows |= {(r["dtype"], r["batch"]): r for r in d["rows"] if r["part"] == "a"}
    a_rows = sorted(a_rows.values(), key=lambda r: (r["batch"], r["dtype"]))
    b_rows = [r for d in docs for r in d["rows"] if r["part"] == "b"]
    new_tokens = docs[0]["args"]["new_tokens"]
    md = ["### (a) guided: JSON schema vs free decoding of the same lengths, by batch", "",
          f"Greedy, ≤ {new_tokens} new tokens; tok/s = generated tokens / wall time of generate() (prefill "
          "included). ratio = constrained ÷ free (floor 0.90, goal 0.97); ff-off = constrained without "
          "fast-forward; cut = on_length='cut'; hidden = share of mask time overlapped with the forward.", ""]
    md += table(a_rows, [
        ("batch", "batch", "d"), ("dtype", "dtype", ""), ("tokens", "tokens", "d"),
        ("valid JSON", "valid_json", "d"), ("constrained tok/s", "constrained_tok_s", ".1f"),
        ("free tok/s", "free_tok_s", ".1f"), ("constrained ÷ free", "constrained_over_free", ".3f"),
        ("ff-off ÷ free", "ff_off_over_free", ".3f"),
        ("forced tokens", "forced_tokens", "d"), ("mask ms", "mask_ms", ".1f"),
        ("mask hidden %", "mask_hidden_pct", ".0f"), ("cut ÷ free", "cut_over_free", ".3f"),
        ("cut valid", "cut_valid_json", "d")])

    def draw(ax):
        lines(ax, a_rows, "batch", "constrained_over_free", lambda r: f"guided {r['dtype']}")
        ax.axhline(0.90, color="grey", linestyle=":", label="floor 0.90")
        ax.axhline(0.97, color="grey", linestyle="--", label="goal 0.97")
        finish(ax, "Constrained ÷ free throughput", "batch size (sequences)",
               "constrained tok/s ÷ free tok/s (ratio)", [r["batch"] for r in a_rows])
    if a_rows:
        md += figure(out, "e2e_ratio", "Guided decoding cost (JSON schema, same output lengths)", draw)
    if b_rows:
        md += [f"### (b) constrained decoding vs transformers + grammar processors, batch "
               f"{b_rows[0]['batch']}", "",
               "Same schema and prompt tokens, greedy; transformers counts tokens up to its end token.", ""]
        md += table(b_rows, [("engine", "engine", ""), ("dtype", "dtype", ""), ("tokens", "tokens", "d"),
                             ("valid JSON", "valid_json", "d"),
                             ("constrained tok/s", "constrained_tok_s", ".1f")])
    return md


def serve_section(docs: list[dict], out: Path) -> list[str]:
    d = docs[0]
    rows, a = d["rows"], d["args"]
    md = [f"{a['requests']} requests per (workload, clients), ≤ {a['max_tokens']} tokens, temperature 0.7, "
          "streaming. TTFT = time to the first streamed token; ITL = inter-token latency (stream time "
          "÷ tokens). A tool call arrives whole: its TTFT is the whole call's time, its ITL means "
          "nothing.", ""]
    level = lambda r: (r["workload"], r["clients"])  # noqa: E731
    peer = {level(r): r["tok_s"] for r in rows if r["server"] != "guided"}
    md += table(rows, [("server", "server", ""), ("workload", "workload", ""), ("clients", "clients", "d"),
                       ("requests", "requests", "d"), ("tok/s", "tok_s", ".1f"),
                       ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
                       ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
                       ("tok/s ÷ peer", lambda r: r["tok_s"] / peer[level(r)]
                        if r["server"] == "guided" and level(r) in peer else None, ".2f")])
    label = lambda r: f"{r['server']} {r['workload']}"  # noqa: E731
    xs = [r["clients"] for r in rows]

    def throughput(ax):
        lines(ax, rows, "clients", "tok_s", label)
        finish(ax, "Throughput", "concurrent clients", "output tokens/s (all clients)", xs)

    def latency(ttft, itl):
        streamed = [r for r in rows if r["workload"] != "tool"]
        for ax, key, name, shown in (
                (ttft, "ttft", "Time to first token", rows),
                (itl, "itl", "Inter-token latency (tool left out: calls arrive whole)", streamed)):
            p50_p99(ax, shown, "clients", key + "_p{}_ms", label)
            finish(ax, name, "concurrent clients", f"{key.upper()} ms (log scale)", xs, logy=True)
    return (md + figure(out, "serve_throughput", "HTTP server under streaming clients", throughput)
            + figure(out, "serve_latency", "HTTP server latency, p50 and p99", latency, 2))


def masks_section(docs: list[dict], out: Path) -> list[str]:
    rows = docs[0]["rows"]
    cell = lambda r: (r["tokenizer"], r["grammar"], r["batch"])  # noqa: E731
    guided = {cell(r): r["step_us_p50"] for r in rows if r["engine"] == "guided"}
    md = ["Time to fill the whole [batch, vocab/32] mask of one decode step, along real instances of a JSON "
          "schema and a Lark (SQL) grammar; per row = p50 ÷ batch. ÷ guided > 1: guided is faster.", ""]
    md += table(rows, [("tokenizer", "tokenizer", ""), ("vocab", "vocab", "d"), ("grammar", "grammar", ""),
                       ("batch", "batch", "d"), ("engine", "engine", ""), ("p50 µs", "step_us_p50", ".1f"),
                       ("p99 µs", "step_us_p99", ".1f"), ("per row µs", "row_us_p50", ".1f"),
                       ("steps", "steps", "d"),
                       ("p50 ÷ guided", lambda r: r["step_us_p50"] / max(guided[cell(r)], 1e-9)
                        if cell(r) in guided else None, ".2f")])
    panels = list(dict.fromkeys((r["tokenizer"], r["vocab"], r["grammar"]) for r in rows))

    def draw(*axes):
        for ax, (tok, vocab, grammar) in zip(axes, panels):
            mine = [r for r in rows if (r["tokenizer"], r["grammar"]) == (tok, grammar)]
            p50_p99(ax, mine, "batch", "step_us_p{}", lambda r: r["engine"])
            finish(ax, f"{grammar} grammar, {tok} ({vocab} tokens)", "batch size (rows)",
                   "mask time per step, µs (log scale)", [r["batch"] for r in mine], logy=True)
    ncols = min(2, len(panels))
    return md + figure(out, "masks", "Grammar mask time per decode step", draw,
                       shape=((len(panels) + ncols - 1) // ncols, ncols))


SECTIONS = {  # bench: (heading, section builder)
    "bench_generate": ("Decode and prefill: guided vs transformers vs llama.cpp", generate_section),
    "bench_guided_e2e": ("Guided decoding end to end", e2e_section),
    "bench_serve": ("HTTP server under concurrent streaming clients", serve_section),
    "bench_masks": ("Grammar mask time per step: guided vs llguidance vs xgrammar", masks_section),
}


def build(data: Path, out: Path) -> None:
    """OUT/README.md and the plots from the JSON files in data."""
    docs = [json.loads(p.read_text()) for p in sorted(data.glob("*.json"))]
    docs.sort(key=lambda d: list(RUNS).index(d["name"]) if d.get("name") in RUNS else len(RUNS))
    total = sum(d.get("wall_s", 0) for d in docs)
    md = ["# Benchmark report", "",
          f"Written {datetime.now():%Y-%m-%d %H:%M} by `benches/report.py` (`make bench-report`) from "
          f"`{data}`" + (f"; the benches took {duration(total)} in all." if total else "."), ""]
    md += machine_section(docs)
    for bench, (heading, section) in SECTIONS.items():
        mine = [d for d in docs if d.get("bench") == bench]
        md += [f"## {heading}", ""]
        if not mine:
            md += ["Not run.", ""]
            continue
        for d in mine:
            how = (f"{bench}.py " + " ".join(f"{k}={v}" for k, v in d["args"].items() if k != "json")
                   if "args" in d else d["command"])  # a bench that failed before writing its JSON
            took = f", {duration(d['wall_s'])}" if "wall_s" in d else ""
            md.append(f"- `{how}`{took}" + (", **failed** (below)" if "error" in d else ""))
        md.append("")
        for d in mine:
            if "error" in d:
                md += ["```", d["error"], "```", ""]
        ok = [d for d in mine if d.get("rows")]
        if ok:
            try:
                md += section(ok, out)
            except Exception:  # a report with a hole beats none
                traceback.print_exc()
                md += ["Report error:", "```", traceback.format_exc(limit=3), "```", ""]
    (out / "README.md").write_text("\n".join(md))
    print(f"wrote {out / 'README.md'}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-report"))
    ap.add_argument("--from", dest="source", type=Path, metavar="DIR",
                    help="rebuild the report from DIR's JSON files; run nothing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.source:
        build(args.source, args.out)
        return
    data = args.out / "data"
    data.mkdir(exist_ok=True)
    for old in [*data.glob("*.json"), *data.glob("*.log"), *args.out.glob("*.png")]:
        old.unlink()
    for name in RUNS:
        run(name, data)
        build(data, args.out)


if __name__ == "__main__":
    main()
