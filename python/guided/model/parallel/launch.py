"""Starting the ranks: rank 0 starts the others on this host (or meets
those a launcher started, through env:// rendezvous) and tells them, through
the store, what to load."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ...processes import die_with_parent, free_port
from .group import START_TIMEOUT, TensorGroup

log = logging.getLogger("guided.model.parallel")

SETUP_KEY = "guided/setup"   # what rank 0 tells the others to load (RankSetup as JSON)


def launched_rank() -> int | None:
    """This process's RANK when it was started for env:// rendezvous
    (torchrun or by hand), else None."""
    return int(os.environ["RANK"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else None


@dataclass(frozen=True)
class RankSetup:
    """What every rank loads and how it sizes its KV cache: rank 0 says it
    (through the store) and the others build their model runner from it."""

    model: str                    # the model file or directory
    device: str
    dtype: str | None             # a torch dtype's name ("bfloat16"), or None for the default
    block_size: int
    kv_cache_tokens: int | None
    max_num_seqs: int
    max_model_len: int            # within the model's positions


def rank_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return dev


def start(size: int, setup: RankSetup) -> TensorGroup:
    """On rank 0: a group of ``size`` ranks. Under env:// rendezvous
    (WORLD_SIZE set) the other ranks were started by the launcher; otherwise
    they are started here, one process each on this host. ``setup`` (what to
    load, the KV cache's sizes) reaches them through the store. The group is
    not connected yet: load this rank's part, then ``connect()``."""
    if launched_rank() is not None:
        world, rank = int(os.environ["WORLD_SIZE"]), launched_rank()
        if world != size:
            raise ValueError(f"WORLD_SIZE={world} is not tensor_parallel_size={size}: every rank "
                             "of the group is one process")
        if rank != 0:
            raise ValueError(f"this process is rank {rank}: only rank 0 runs the engine; run the "
                             "others with `python -m guided.model.worker`")
        host, port, workers, threads = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), [], None
    else:
        host, port = "127.0.0.1", free_port()
        threads = max(1, torch.get_num_threads() // size)   # this process's share (OMP_NUM_THREADS)
        workers = None
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed group (a tensor-parallel "
                           "LLM not closed?): one per process; close() the other first")
    store = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False,
                          timeout=START_TIMEOUT)
    store.set(SETUP_KEY, json.dumps(asdict(setup)))
    if workers is None:
        env = dict(os.environ, MASTER_ADDR=host, MASTER_PORT=str(port), WORLD_SIZE=str(size),
                   GUIDED_TP_THREADS=str(threads))
        workers = [subprocess.Popen([sys.executable, "-m", "guided.model.worker"],
                                    env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                    preexec_fn=die_with_parent) for r in range(1, size)]
        log.info("started tensor-parallel ranks 1..%d on this host (%d torch threads each)",
                 size - 1, threads)
    return TensorGroup(0, size, rank_device(setup.device), store, workers, threads)
