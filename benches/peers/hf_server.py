"""The pure-Python stack a user would glue together, as a minimal
OpenAI-compatible server: transformers ``generate`` on the default GGUF
(fp32), xgrammar's HF logits processor for response_format json_schema, a
TextIteratorStreamer for SSE. One request at a time (HF ``generate`` has no
continuous batching); concurrent clients queue on a lock.

    python benches/peers/hf_server.py --port 8001

Used by benches/bench_serve.py; not part of guided.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import torch
import transformers
import uvicorn
import xgrammar as xgr
import xgrammar.contrib.hf as xhf
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from guided.model import default_model_path


def create_app() -> FastAPI:
    path = Path(default_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    eos_ids = sorted(set(eos_ids) | {tok.convert_tokens_to_ids("<|im_end|>")})
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size,
                                              stop_token_ids=eos_ids)
    compiler = xgr.GrammarCompiler(info)
    lock = asyncio.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "hf", "object": "model", "created": 0,
                                            "owned_by": "bench"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        processors = []
        rf = body.get("response_format") or {}
        if rf.get("type") == "json_schema":
            compiled = compiler.compile_json_schema(json.dumps(rf["json_schema"]["schema"]))
            processors.append(xhf.LogitsProcessor(compiled))
        streamer = transformers.TextIteratorStreamer(tok, skip_prompt=True,
                                                     skip_special_tokens=True)
        if body.get("seed") is not None:
            torch.manual_seed(body["seed"])
        temperature = float(body.get("temperature", 1.0))
        kwargs = dict(input_ids=ids, max_new_tokens=int(body.get("max_tokens") or 256),
                      do_sample=temperature > 0, temperature=temperature or None,
                      top_p=None, top_k=None, eos_token_id=eos_ids, streamer=streamer,
                      logits_processor=processors, pad_token_id=eos_ids[0])
        head = {"id": "chatcmpl-hf", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": "hf"}

        async def events():
            async with lock:
                out = {}
                worker = threading.Thread(target=lambda: out.setdefault(
                    "ids", model.generate(**kwargs)))
                worker.start()
                iterator = iter(streamer)
                while True:
                    piece = await asyncio.to_thread(next, iterator, None)
                    if piece is None:
                        break
                    if piece:
                        chunk = {**head, "choices": [{"index": 0, "delta": {"content": piece},
                                                      "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.to_thread(worker.join)
                new = int(out["ids"].shape[1] - ids.shape[1])
                yield f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
                usage = {"prompt_tokens": int(ids.shape[1]), "completion_tokens": new,
                         "total_tokens": int(ids.shape[1]) + new}
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level=args.log_level)
