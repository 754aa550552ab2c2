"""`python -m guided.model.worker`: a tensor-parallel rank other than 0
(guided/model/parallel/). ``LLM(tensor_parallel_size=N)`` starts these on
its host; on other hosts torchrun or a person starts them with the env://
variables (``python -m guided.serve`` does the same when RANK > 0)."""
from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist

from .loader import load_model
from .parallel import (SETUP_KEY, START_TIMEOUT, RankSetup, TensorGroup, failed, launched_rank,
                       rank_device)
from .runner import ModelRunner

log = logging.getLogger("guided.model.worker")


def run_worker() -> None:
    """Load this rank's part of the model rank 0 names, then run forward
    passes until rank 0 stops."""
    rank = launched_rank()
    if not rank:
        raise SystemExit("guided.model.worker runs ranks 1..N-1: set RANK, WORLD_SIZE, MASTER_ADDR "
                         "and MASTER_PORT (torchrun does)")
    size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=False, timeout=START_TIMEOUT)
    setup = RankSetup(**json.loads(store.get(SETUP_KEY)))
    if threads := os.environ.get("GUIDED_TP_THREADS"):
        torch.set_num_threads(int(threads))
    try:
        group = TensorGroup(rank, size, rank_device(setup.device), store)
        loaded = load_model(setup.model, device=str(group.device), dtype=setup.dtype,
                            tensor_group=group)
    except Exception as exc:
        store.set(failed(rank), f"{type(exc).__name__}: {exc}")
        raise
    group.connect()
    runner = ModelRunner(loaded, setup.block_size, setup.kv_cache_tokens, setup.max_num_seqs,
                         setup.max_model_len)
    steps = 0
    while (arrays := group.receive_step()) is not None:
        runner.execute(arrays)
        steps += 1
    log.info("tensor-parallel rank %d stops after %d steps", rank, steps)
    group.close()


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("GUIDED_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker()
