"""The slots: one Engine and one worker thread each (--parallel), a bounded FIFO in front.

With several slots their engines share one Batcher (inference/batch.py): the workers sample
and stream, its thread runs every model call, one pass a step for all the sequences."""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from typing import AsyncIterator

from kestrel_cli.core.errors import KestrelError, ModelError
from kestrel_cli.inference.batch import Batcher
from kestrel_cli.inference.engine import Engine
from kestrel_cli.inference.generate import Chunk
from kestrel_cli.server.models import APIError

log = logging.getLogger("kestrel.server")

_END = object()  # job.events: the worker is done with this job
_CANCELLED = object()  # job.events: the client went away


# ---------------------------------------------------------------------------- scheduling


class Job:
    """One generation request, from the queue to its last chunk."""

    def __init__(
        self,
        ids: list[int],
        params: dict,
        loop: asyncio.AbstractEventLoop,
        cache_prompt: bool = True,
        timeout: float | None = None,
    ):
        self.ids, self.params, self.loop = ids, params, loop
        # the wall-clock limit (--request-timeout), from admission: checked between tokens
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.cache_prompt = cache_prompt  # False: prefill the whole prompt (llama-server's)
        self.events: asyncio.Queue = asyncio.Queue()  # Chunk | APIError | _END | _CANCELLED
        self.cancelled = False  # set in the loop thread, read by the worker between tokens
        self.state = "queued"  # queued -> running -> done
        self.gen_ms = 0.0  # wall time from the end of prefill to the last token
        self.t_first: float | None = None  # when the first token reached the handler
        self.n_tokens = 0  # tokens that reached the handler

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def timeout_error(self) -> APIError:
        return APIError(
            f"the request ran past the server's time limit of {self.timeout:g} s "
            f"(--request-timeout)",
            504,
            code="request_timeout",
        )

    def post(self, item) -> None:
        """From the worker thread: hand an event to the request's handler."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The worker's chunks; raises APIError on an engine error, stops on cancel."""
        while True:
            ev = await self.events.get()
            if ev is _END or ev is _CANCELLED:
                return
            if isinstance(ev, APIError):
                raise ev
            if ev.token is not None:
                self.n_tokens += 1
                self.t_first = self.t_first or time.perf_counter()
            yield ev


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Slot:
    """One engine and the worker thread that drives it."""

    def __init__(self, index: int, engine: Engine):
        self.index, self.engine = index, engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.job: Job | None = None
        self.thread: threading.Thread | None = None


class Ticket:
    """A request's reserved place (Scheduler.reserve), given back once: when its job is
    queued, or when its preparation fails."""

    def __init__(self, sched: "Scheduler"):
        self.sched, self.live = sched, True

    def release(self) -> None:
        if self.live:
            self.live = False
            self.sched.preparing -= 1


class Scheduler:
    """A bounded FIFO of jobs in front of the slots. All its state lives in the event loop
    thread; workers only run jobs and post events back (call_soon_threadsafe)."""

    def __init__(self, engines: list[Engine], queue_size: int, batcher: Batcher | None = None):
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        # with a batcher, its one thread runs the engines' model calls (continuous batching)
        self.batcher = batcher
        if batcher is not None:
            for e in engines:
                e.batcher = batcher
        self.idle = list(self.slots)
        self.pending: collections.deque[Job] = collections.deque()
        self.queue_size = queue_size
        self.preparing = 0  # requests holding a Ticket (being rendered and tokenised)
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- loop thread
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for s in self.slots:
            s.thread = threading.Thread(
                target=self._work, args=(s,), daemon=True, name=f"kestrel-slot-{s.index}"
            )
            s.thread.start()

    def reserve(self) -> "Ticket":
        """A place for a request about to be prepared (template, tokeniser, images): taken
        before that work, so the queue's bound holds for it too. Requests in preparation,
        queued and running together are at most the slots plus --queue-size; one more gets
        503 server_busy."""
        if self.closing:
            raise APIError("the server is shutting down", 503)
        running = len(self.slots) - len(self.idle)
        if self.preparing + len(self.pending) + running >= len(self.slots) + self.queue_size:
            raise APIError(
                f"server busy: {running} running, {len(self.pending)} queued and "
                f"{self.preparing} in preparation for {len(self.slots)} slot(s) and "
                f"a queue of {self.queue_size}; retry later",
                503,
                code="server_busy",
            )
        self.preparing += 1
        return Ticket(self)

    def submit(self, job: Job, ticket: "Ticket | None" = None) -> None:
        """Queue `job`: in the place `ticket` reserved, or in a free one (else 503)."""
        if self.closing:
            raise APIError("the server is shutting down", 503)
        if ticket is not None and ticket.live:
            ticket.release()
        elif not self.idle and len(self.pending) >= self.queue_size:
            raise APIError(
                f"server busy: {len(self.pending)} requests already wait for "
                f"{len(self.slots)} slot(s); retry later",
                503,
                code="server_busy",
            )
        self.pending.append(job)
        self._dispatch()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job from the queue, or stop it at the next token."""
        if job.state == "done" or job.cancelled:
            return
        job.cancelled = True
        if job.state == "queued":
            try:
                self.pending.remove(job)
            except ValueError:
                pass
            job.state = "done"
        job.events.put_nowait(_CANCELLED)

    def _dispatch(self) -> None:
        while self.pending and self.idle:
            job = self.pending.popleft()
            if job.expired():  # waited in the queue past its time limit
                job.state = "done"
                job.events.put_nowait(job.timeout_error())
                continue
            # the idle slot whose KV cache shares the longest prefix with the prompt; on a
            # tie the one holding least, so other conversations keep their caches
            slot = max(
                self.idle,
                key=lambda s: (
                    _common_prefix(s.engine.cached_ids, job.ids),
                    -len(s.engine.cached_ids),
                ),
            )
            self.idle.remove(slot)
            slot.job, job.state = job, "running"
            slot.inbox.put(job)

    def _finished(self, slot: Slot, job: "Job") -> None:
        self._released(slot)
        job.events.put_nowait(_END)

    def _released(self, slot: Slot) -> None:
        if slot.job is not None:
            slot.job.state = "done"
        slot.job = None
        self.idle.append(slot)
        self.idle.sort(key=lambda s: s.index)
        self._dispatch()

    async def on_idle_slot(self, index: int, fn):
        """Run fn(engine) in a worker thread on slot `index` while it is idle (slot save /
        restore): the slot is taken off the idle list meanwhile; 404 for no such slot,
        503 when it is answering a request."""
        if not 0 <= index < len(self.slots):
            raise APIError(f"no slot {index}: the slots are 0..{len(self.slots) - 1}", 404)
        slot = self.slots[index]
        if slot not in self.idle:
            raise APIError(f"slot {index} is busy; retry later", 503, code="server_busy")
        self.idle.remove(slot)
        try:
            return await asyncio.to_thread(fn, slot.engine)
        finally:
            self._released(slot)

    def begin_shutdown(self, cancel_running: bool = False) -> None:
        """SIGINT/SIGTERM: refuse new work, fail the queued jobs with 503; running jobs
        finish (until abort_running, at the --shutdown-timeout deadline) unless
        `cancel_running`."""
        self.closing = True
        while self.pending:
            job = self.pending.popleft()
            job.state = "done"
            job.events.put_nowait(APIError("the server is shutting down", 503))
        if cancel_running:
            self.abort_running()

    def abort_running(self) -> None:
        """The drain deadline: each running job ends now with a 503 error (a stream gets an
        error event and [DONE]); its worker stops at the next token."""
        for s in self.slots:
            job = s.job
            if job is not None and not job.cancelled:
                job.cancelled = True
                job.events.put_nowait(
                    APIError(
                        "the server is shutting down; the reply was cut short",
                        503,
                        code="shutting_down",
                    )
                )

    async def close(self) -> None:
        self.begin_shutdown(cancel_running=True)
        for s in self.slots:
            s.inbox.put(None)
        for s in self.slots:
            if s.thread is not None:
                await asyncio.to_thread(s.thread.join, 10.0)
        if self.batcher is not None:
            await asyncio.to_thread(self.batcher.close)

    def health(self) -> dict:
        return {
            "status": "shutting down" if self.closing else "ok",
            "slots_idle": len(self.idle),
            "slots_processing": len(self.slots) - len(self.idle),
            "requests_queued": len(self.pending),
            "requests_preparing": self.preparing,
        }

    # -- worker threads
    def _work(self, slot: Slot) -> None:
        while True:
            job = slot.inbox.get()
            if job is None:
                return
            try:
                self._run(slot.engine, job)
            finally:
                # one callback: the slot is idle again before the handler sees the end, so
                # a client that sends its next request at once never finds it still busy
                self.loop.call_soon_threadsafe(self._finished, slot, job)

    def _run(self, eng: Engine, job: Job) -> None:
        if job.cancelled:
            return
        gen = None
        t0 = time.perf_counter()
        try:
            if not job.cache_prompt:
                eng.reset()
            gen = eng.stream(job.ids, **job.params)
            for chunk in gen:
                if chunk.stats is not None:
                    job.gen_ms = (time.perf_counter() - t0) * 1e3 - chunk.stats.prefill_ms
                job.post(chunk)
                if job.cancelled:  # checked between tokens: stops within one token
                    break
                if chunk.finish_reason is None and job.expired():
                    job.post(job.timeout_error())
                    break
        except ModelError as e:  # the model file is at fault (NaN logits): not the client
            log.error(f"model error: {e}")
            job.post(APIError(str(e), 500, code="model_error"))
        except KestrelError as e:
            job.post(APIError(str(e), 400))
        except Exception as e:  # never let a request kill the worker
            log.exception("generation failed")
            eng.reset()  # the KV cache may be half-written
            job.post(APIError(f"internal error: {type(e).__name__}", 500))
        finally:
            if gen is not None:
                gen.close()
            if self.batcher is not None:  # the batch steps stop waiting for this sequence
                self.batcher.leave(eng)
