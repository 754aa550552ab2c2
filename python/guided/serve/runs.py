"""One HTTP request's choices in the engine: opened together, watched
together, closed together (a client that goes away aborts all of them).

n choices of one prompt share its KV blocks through the prefix cache: the
first choice is admitted alone and the others only once its prefill is done,
so they find the prompt's full blocks cached instead of computing them again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..engine import StepUpdate
from ..grammar import ComposedGrammar
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .admission import Admission
from .async_engine import FAILED_STEP, AsyncEngine
from .errors import APIError
from .metrics import Metrics

log = logging.getLogger("guided.serve")


@dataclass
class Job:
    """One choice: ``group`` is its prompt's index (choices of a group share it)."""

    prompt_ids: list[int]
    params: SamplingParams
    grammar: ComposedGrammar | None
    group: int = 0


@dataclass
class _Choice:
    stream: AsyncIterator[StepUpdate]
    first: StepUpdate
    first_at: float
    last_at: float
    final: RequestOutput | None = None


@dataclass
class Run:
    engine: AsyncEngine
    admission: Admission
    metrics: Metrics
    endpoint: str
    request_id: str
    began: float = field(default_factory=time.perf_counter)
    choices: list[_Choice] = field(default_factory=list)
    ttft: float | None = None
    _held: int = 0
    _pumps: list = field(default_factory=list)

    async def open(self, jobs: list[Job]) -> None:
        """Admit every job or none: raises APIError (400 refused, 503 full)."""
        self.admission.acquire(len(jobs))
        self._held = len(jobs)
        opened: dict[int, _Choice] = {}
        try:
            leaders = {}
            for i, job in enumerate(jobs):
                leaders.setdefault(job.group, i)
            await self._start(jobs, list(leaders.values()), opened)
            await self._start(jobs, [i for i in range(len(jobs)) if i not in opened], opened)
        except BaseException:
            self.choices = list(opened.values())
            await self.close()
            raise
        self.choices = [opened[i] for i in range(len(jobs))]
        self.ttft = min(c.first_at for c in self.choices) - self.began
        self.metrics.ttft.observe(self.ttft)

    async def _start(self, jobs: list[Job], which: list[int], opened: dict[int, _Choice]) -> None:
        async def one(i: int) -> None:
            job = jobs[i]
            stream = self.engine.generate(job.prompt_ids, job.params, job.grammar)
            try:
                first = await stream.__anext__()
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
            if _refused(first):
                raise APIError(400, first.finished.error)
            now = time.perf_counter()
            opened[i] = _Choice(stream, first, now, now)
        results = await asyncio.gather(*(one(i) for i in which), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def updates(self) -> AsyncIterator[tuple[int, StepUpdate]]:
        """(choice index, update) as they arrive, each choice's first update
        first; ends when every choice has finished."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, choice: _Choice) -> None:
            try:
                await queue.put((i, choice.first))
                async for update in choice.stream:
                    await queue.put((i, update))
            finally:
                await queue.put((i, None))

        self._pumps = [asyncio.create_task(pump(i, c)) for i, c in enumerate(self.choices)]
        live = len(self._pumps)
        try:
            while live:
                i, update = await queue.get()
                if update is None:
                    live -= 1
                    continue
                self._observe(i, update)
                yield i, update
        finally:
            await self._stop_pumps()

    async def _stop_pumps(self) -> None:
        """Cancel and wait for the pumps, so that no stream is still being
        read when close() ends them (a consumer that stopped early may leave
        its generator to the garbage collector)."""
        pumps, self._pumps = self._pumps, []
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    async def finals(self) -> list[RequestOutput]:
        async for _ in self.updates():
            pass
        return [c.final for c in self.choices]

    def _observe(self, i: int, update: StepUpdate) -> None:
        choice = self.choices[i]
        now = time.perf_counter()
        if update is not choice.first and update.token_ids:
            self.metrics.inter_token.observe((now - choice.last_at) / len(update.token_ids))
        choice.last_at = now
        if update.finished is not None:
            choice.final = update.finished

    async def close(self, status: int = 200) -> None:
        """Abort what is still running, free admission, and log the request."""
        await self._stop_pumps()
        for c in self.choices:
            await c.stream.aclose()
        self.admission.release(self._held)
        self._held = 0
        finals = [c.final for c in self.choices if c.final is not None]
        if not self.choices:
            return
        if len(finals) < len(self.choices):
            status = 499  # the client went away
        self.metrics.finished(self.endpoint, status, [f.finish_reason for f in finals],
                              time.perf_counter() - self.began)
        log.info("%s %s %d choices=%d finish=%s prompt=%d cached=%d completion=%d forced=%d "
                 "ttft=%.3fs total=%.3fs", self.endpoint, self.request_id, status, len(self.choices),
                 ",".join(sorted({f.finish_reason for f in finals})) or "-",
                 sum(len(f.prompt_token_ids) for f in finals),
                 sum(f.num_cached_tokens for f in finals),
                 sum(len(f.token_ids) for f in finals),
                 sum(f.num_forced_tokens for f in finals),
                 self.ttft or 0.0, time.perf_counter() - self.began)


def _refused(first: StepUpdate) -> bool:
    """A request the engine ended at its first step, before any output, for
    a reason of its own (a schema whose shortest instance does not fit in
    max_tokens): the client's error, answered as a 400. A failed engine
    step (``Engine.fail_all``) is not the client's doing and stays a
    finish_reason."""
    done = first.finished
    return (done is not None and done.finish_reason == "error" and not done.token_ids
            and done.error is not None and not done.error.startswith(FAILED_STEP))
