"""Drives the synchronous Engine from one background thread for asyncio callers.

The engine (and its Rust scheduler) is only ever touched by that thread:
requests and aborts reach it through queues, and updates go back to each
request's asyncio queue with call_soon_threadsafe. A client that disconnects
aborts its request, so its KV blocks are freed at once.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from ..engine import Engine, RequestGrammar, StepUpdate
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .kv_events import KvEventPublisher

log = logging.getLogger("guided.serve")

# How requests that a failed engine step ended say so (their error begins so).
FAILED_STEP = "engine step failed"


@dataclass
class _Submission:
    prompt_ids: list[int]
    params: SamplingParams
    grammar: RequestGrammar | None
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue
    accepted: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: Engine, kv_events: KvEventPublisher | None = None):
        """``kv_events``: where each step's prefix-cache changes go (a router
        reads them), if anywhere."""
        self.engine = engine
        self.kv_events = kv_events
        if kv_events is not None:
            engine.record_cache_events()
        self.stats: dict[str, int] = engine.stats()  # snapshot taken by the engine thread
        self._inbox: queue.SimpleQueue[_Submission | int] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, _Submission] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="guided-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       grammar: RequestGrammar | None = None) -> AsyncIterator[StepUpdate]:
        """Stream one request's updates; raises ValueError if it is refused.
        ``grammar``: the request's composed grammar, see Engine.add_request."""
        loop = asyncio.get_running_loop()
        sub = _Submission(prompt_ids, params, grammar, loop, asyncio.Queue(), loop.create_future())
        self._post(sub)
        rid = await sub.accepted
        finished = False
        try:
            while not finished:
                update: StepUpdate = await sub.updates.get()
                finished = update.finished is not None
                yield update
        finally:
            if not finished:  # the client went away: free its blocks now
                self._post(rid)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    # -- engine thread ---------------------------------------------------

    def _post(self, item: _Submission | int) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            if self._drain_inbox():
                self.stats = self.engine.stats()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                updates = self.engine.step()
            except Exception as exc:  # keep serving: fail what was running (rule 12)
                log.exception(FAILED_STEP)
                updates = self.engine.fail_all(f"{FAILED_STEP}: {exc}")
            self.stats = self.engine.stats()
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.take_cache_events())
            for update in updates:
                self._deliver(update)

    def _drain_inbox(self) -> bool:
        """Admit new requests and apply aborts; True if there were any."""
        drained = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if isinstance(item, int):
                self.engine.abort(item)
                self._streams.pop(item, None)
            else:
                self._admit(item)

    def _admit(self, sub: _Submission) -> None:
        try:
            rid = self.engine.add_request(sub.prompt_ids, sub.params, sub.grammar)
        except ValueError as exc:
            sub.loop.call_soon_threadsafe(self._settle, sub.accepted, None, exc)
            return
        self._streams[rid] = sub
        sub.loop.call_soon_threadsafe(self._settle, sub.accepted, rid, None)

    def _deliver(self, update: StepUpdate) -> None:
        sub = self._streams.get(update.request_id)
        if sub is None:
            return
        if update.finished is not None:
            del self._streams[update.request_id]
        sub.loop.call_soon_threadsafe(sub.updates.put_nowait, update)

    def _settle(self, future: asyncio.Future, rid: int | None, error: Exception | None) -> None:
        """Runs on the caller's loop. A caller that gave up before its request
        was admitted gets it aborted instead."""
        if future.cancelled():
            if rid is not None:
                self._post(rid)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(rid)
