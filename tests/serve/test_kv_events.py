"""KV-cache events (serve/kv_events.py) as vllm-router's kv_aware policy reads
them: a subscriber that applies every BlockStored and BlockRemoved ends up
holding exactly the blocks in the engine's prefix cache, evictions included,
with the token ids it needs to hash prompts itself; a late subscriber gets
the whole history from the replay socket."""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from guided import LLM, SamplingParams
from guided.processes import free_port
from guided.serve.kv_events import KvEventPublisher

BLOCK = 16


@pytest.fixture(scope="module")
def small_llm():
    """32 blocks: a few prompts evict each other's blocks."""
    return LLM(dtype="float32", kv_cache_tokens=32 * BLOCK, max_num_seqs=4)


def _receive(sub: zmq.Socket, until_seq: int) -> list[tuple[int, list]]:
    got = []
    while not got or got[-1][0] < until_seq:
        assert sub.poll(5000), f"no event batch after seq {got[-1][0] if got else None}"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        got.append((int.from_bytes(seq, "big", signed=True), msgpack.unpackb(payload)))
    return got


def _apply(held: dict[int, list[int]], batch: list) -> None:
    ts, events = batch
    assert isinstance(ts, float)
    for event in events:
        if event["type"] == "BlockStored":
            assert set(event) == {"type", "block_hashes", "parent_block_hash", "token_ids",
                                  "block_size", "lora_id", "medium", "lora_name"}
            assert event["block_size"] == BLOCK and event["medium"] == "GPU"
            tokens = event["token_ids"]
            assert len(tokens) == BLOCK * len(event["block_hashes"])
            parent = event["parent_block_hash"]
            assert parent is None or parent in held, "a store chained to an unknown block"
            for i, h in enumerate(event["block_hashes"]):
                assert h not in held
                held[h] = tokens[i * BLOCK:(i + 1) * BLOCK]
        else:
            assert event["type"] == "BlockRemoved" and set(event) == {"type", "block_hashes", "medium"}
            for h in event["block_hashes"]:
                del held[h]


def test_a_subscriber_rebuilds_the_prefix_cache_and_a_late_one_replays_it(small_llm):
    engine = small_llm.engine
    engine.record_cache_events()
    pub_at, replay_at = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    publisher = KvEventPublisher(pub_at, replay_at, BLOCK)
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_at)
        time.sleep(0.3)   # a PUB drops what it sends before the subscription arrives
        prompts = [f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 12
                   for i in range(6)]
        params = SamplingParams(temperature=0, max_tokens=8)
        for prompt in prompts:   # one by one: each evicts what the last left
            small_llm.generate(prompt, params, use_tqdm=False)
            publisher.publish(engine.take_cache_events())
        deadline = time.time() + 5
        while publisher.published == 0 or publisher._queue.qsize():
            assert time.time() < deadline
            time.sleep(0.05)
        last = publisher.published - 1
        batches = _receive(sub, last)
        assert [s for s, _ in batches] == list(range(last + 1))
        held: dict[int, list[int]] = {}
        for _, batch in batches:
            _apply(held, batch)
        removed = sum(len(e["block_hashes"]) for _, b in batches for e in b[1]
                      if e["type"] == "BlockRemoved")
        assert removed > 0, "the prompts were meant to evict each other"
        assert len(held) == engine.stats()["num_cached_blocks"]
        # the last prompt's full blocks are all held: the router would credit them
        last_ids = small_llm.tokenizer.encode(prompts[-1])
        blocks = [last_ids[i:i + BLOCK] for i in range(0, len(last_ids) - BLOCK + 1, BLOCK)]
        assert all(b in held.values() for b in blocks)

        replay = ctx.socket(zmq.DEALER)
        replay.connect(replay_at)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        again: dict[int, list[int]] = {}
        seqs = []
        while True:
            assert replay.poll(5000), "the replay stopped short"
            empty, topic, seq, payload = replay.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                break
            seqs.append(seq)
            _apply(again, msgpack.unpackb(payload))
        assert seqs == list(range(last + 1)) and again == held
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_an_endpoint_that_cannot_bind_is_named():
    taken = f"tcp://127.0.0.1:{free_port()}"
    first = KvEventPublisher(taken, None, BLOCK)
    try:
        with pytest.raises(ValueError, match=f"cannot bind {taken}"):
            KvEventPublisher(taken, None, BLOCK)
    finally:
        first.close()
