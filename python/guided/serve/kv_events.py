"""KV-cache events: what enters and leaves this server's prefix cache, for a
router that routes each request to the replica that holds most of its prompt
(vllm-router's ``kv_aware`` policy, ``--kv-event-source``).

The format is vLLM's (vllm/distributed/kv_events.py) as the router reads it:
ZMQ PUB frames ``[topic, seq (8 bytes, big-endian), payload]`` with the
empty topic, the payload a msgpack array ``[ts, events]`` whose events are
maps tagged by ``type``: ``BlockStored`` (hashes of a chain of full blocks,
the parent's hash, their token ids, the block size) and ``BlockRemoved``
(hashes). The router hashes the token ids itself to match prompts; our
hashes (rust/engine/block_manager.rs) only chain blocks and name evictions.

A router that sees a gap in ``seq`` (it connected late, or missed
messages) asks the replay socket (ZMQ ROUTER) for what it missed, from a
sequence number on: ``[identity, b"", start]`` in, ``[identity, b"", topic,
seq, payload]`` out per batch still buffered, then seq -1 to end.

The engine thread hands each step's events to ``publish()``; one thread of
this module owns the sockets (a ZMQ socket is not thread-safe).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import msgpack
import zmq

log = logging.getLogger("guided.serve.kv_events")

#: vLLM's name for the engine's own KV cache (the router credits it in full;
#: host or disk tiers are discounted). It is this server's only tier.
MEDIUM = "GPU"
TOPIC = b""
END_SEQ = -1
#: batches kept for replay, as vLLM's default buffer_steps
BUFFERED = 10_000
#: events per batch, the router's limit
MAX_EVENTS = 4096

#: one event as the scheduler gives it: (stored?, hash, parent hash, token ids)
CacheEvent = tuple[bool, int, int | None, list[int]]


def encode(events: list[CacheEvent], block_size: int, ts: float) -> list[bytes]:
    """Payloads (msgpack) for ``events``: consecutive stores of one chain
    become one BlockStored, consecutive evictions one BlockRemoved."""
    out: list[dict] = []
    for stored, block_hash, parent, tokens in events:
        last = out[-1] if out else None
        if stored:
            if last and last["type"] == "BlockStored" and last["block_hashes"][-1] == parent:
                last["block_hashes"].append(block_hash)
                last["token_ids"].extend(tokens)
                continue
            out.append({"type": "BlockStored", "block_hashes": [block_hash],
                        "parent_block_hash": parent, "token_ids": list(tokens),
                        "block_size": block_size, "lora_id": None, "medium": MEDIUM,
                        "lora_name": None})
        elif last and last["type"] == "BlockRemoved":
            last["block_hashes"].append(block_hash)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": [block_hash], "medium": MEDIUM})
    return [msgpack.packb([ts, out[i:i + MAX_EVENTS]])
            for i in range(0, len(out), MAX_EVENTS)]


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, block_size: int):
        self.endpoint, self.replay_endpoint, self.block_size = endpoint, replay_endpoint, block_size
        self.published = 0   # batches sent
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="guided-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"KV events: cannot bind {self._error}")

    def publish(self, events: list[CacheEvent]) -> None:
        """Queue one step's cache changes (from the engine thread)."""
        if events:
            for payload in encode(events, self.block_size, time.time()):
                self._queue.put(payload)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    # -- the sockets' thread ------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay = ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        for sock, address in ((pub, self.endpoint), (replay, self.replay_endpoint)):
            try:
                if sock is not None:
                    sock.bind(address)
            except zmq.ZMQError as exc:
                self._error = f"{address}: {exc}"
                self._ready.set()
                ctx.destroy(linger=0)
                return
        self._ready.set()
        log.info("KV events on %s (replay: %s)", self.endpoint, self.replay_endpoint or "none")
        sent: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=BUFFERED)
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        seq = 0
        while not self._stopped.is_set():
            while True:
                try:
                    payload = self._queue.get_nowait()
                except queue.Empty:
                    break
                pub.send_multipart([TOPIC, seq.to_bytes(8, "big", signed=True), payload])
                sent.append((seq, payload))
                seq += 1
                self.published = seq
            if replay is None:
                time.sleep(0.02)
            elif poller.poll(timeout=20):
                self._replay(replay, sent)
        ctx.destroy(linger=0)

    def _replay(self, replay, sent) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        for seq, payload in sent:
            if seq >= start:
                replay.send_multipart([identity, b"", TOPIC, seq.to_bytes(8, "big", signed=True),
                                       payload])
        replay.send_multipart([identity, b"", TOPIC, END_SEQ.to_bytes(8, "big", signed=True), b""])
