"""One in-process vLLM engine stepped by a thread of its own, as a server steps it.

``vllm.LLM.generate`` steps the engine only while its own requests run: the
blocks that the offloading connector cascades after a request finishes wait
for the next call, and concurrent callers cannot share a step. A serving
engine (vLLM's ``EngineCore`` busy loop) instead keeps stepping while it has
work, offloads included, and batches whatever has arrived. ``EngineLoop`` does
the same for an engine run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so raykv's tiers live in the caller's Ray worker):

- the engine is built, stepped and shut down on one thread, the loop's;
- ``submit`` hands a request to the loop from any thread and returns a
  `Pending` that completes with the first-token and finish times;
- between requests the loop keeps stepping while the scheduler reports
  work (offloads in flight), so nothing waits for the next request;
- ``cancel`` aborts a request between two steps, as a server does for a
  client that hangs up (``LLMEngine.abort_request``).

Uses ``LLMEngine.add_request`` / ``step`` / ``abort_request`` and the
in-process client's ``engine_core.scheduler.has_requests()`` (checked on
vLLM 0.29 and 0.32): vLLM has no public API for "is offloading done".
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from raykv.core.wire import JsonValue

if TYPE_CHECKING:
    from raykv.integrations.vllm.engines import LLM, RequestOutput, SamplingParams, TokensPrompt

#: How long an idle loop sleeps between offload-only steps (what vLLM's
#: engine does between polls of its connector is a busy step; 2 ms keeps a
#: 2-core host's CPU for the other engines).
OFFLOAD_STEP_PAUSE_S = 0.002


@dataclass
class LoopSteps:
    """What an engine loop's thread spent stepping: steps with requests running and
    offload-only steps (no request left, the scheduler still reporting work), with
    the thread's CPU seconds in each."""

    request_steps: int = 0
    request_cpu_s: float = 0.0
    offload_steps: int = 0
    offload_cpu_s: float = 0.0


class RequestCancelled(RuntimeError):
    """The request was aborted before it finished (``EngineLoop.cancel``)."""


@dataclass
class Pending:
    """One submitted request: done once the engine finished it (or failed)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    output: RequestOutput | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    request_id: str | None = None  # the engine's, once admitted

    def result(self, timeout_s: float) -> RequestOutput:
        """The finished ``RequestOutput``; raises the engine's error, or TimeoutError."""
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"request not finished in {timeout_s} s")
        if self.error is not None:
            raise self.error
        if self.output is None:
            raise RuntimeError("request done without an output")
        return self.output


class EngineLoop:
    """A ``vllm.LLM`` owned and stepped by one background thread."""

    def __init__(
        self, model: str, kv_transfer_config: Mapping[str, JsonValue] | None, engine_kwargs: Mapping[str, JsonValue]
    ) -> None:
        self._llm: LLM | None = None
        self.load_s = 0.0
        self._inbox: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue[Pending] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle_lock = threading.Lock()  # "idle" is set only while the inbox is seen empty
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._ready = threading.Event()
        self.steps = LoopSteps()  # written by the loop's thread only
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(model, kv_transfer_config, engine_kwargs), name="raykv-engine-loop", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def llm(self) -> LLM:
        """The engine (built by the constructor)."""
        if self._llm is None:
            raise RuntimeError("the engine loop has no engine")
        return self._llm

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Pending:
        """Queue a request for the next step; never blocks."""
        if self._stop.is_set():
            raise RuntimeError("the engine loop is shut down")
        pending = Pending(list(prompt_token_ids), params)
        with self._idle_lock:
            self._idle.clear()
            self._inbox.put(pending)
        self._wake.set()
        return pending

    def cancel(self, pending: Pending) -> None:
        """Abort ``pending`` before the next step, as a server does for a client that
        hangs up; its ``result`` then raises ``RequestCancelled``. Never blocks; a
        request that finished first keeps its result."""
        self._cancels.put(pending)
        self._wake.set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the engine has no requests and no offloads in flight; True when it has none."""
        return self._idle.wait(timeout_s)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(
        self, model: str, kv_transfer_config: Mapping[str, JsonValue] | None, engine_kwargs: Mapping[str, JsonValue]
    ) -> None:
        try:
            from raykv.integrations.vllm.engines import build_llm

            t0 = time.perf_counter()
            self._llm = llm = build_llm(model, kv_transfer_config, engine_kwargs)
            self.load_s = time.perf_counter() - t0
        except BaseException as e:  # reported to the constructor's caller
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        running: dict[str, Pending] = {}
        try:
            while not self._stop.is_set():
                self._admit(llm, running)
                self._cancel(llm, running)
                if not running and not self._has_offload_work(llm):
                    with self._idle_lock:
                        if self._inbox.empty():
                            self._idle.set()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                offload_only = not running
                cpu0 = time.thread_time()
                self._step(llm, running)
                self._count(offload_only, time.thread_time() - cpu0)
                if not running:
                    self._wake.wait(OFFLOAD_STEP_PAUSE_S)
                    self._wake.clear()
        finally:
            for p in running.values():
                p.error = p.error or RuntimeError("engine loop stopped")
                p.done.set()
            llm.llm_engine.engine_core.shutdown()

    def _count(self, offload_only: bool, cpu_s: float) -> None:
        steps = self.steps
        if offload_only:
            steps.offload_steps += 1
            steps.offload_cpu_s += cpu_s
        else:
            steps.request_steps += 1
            steps.request_cpu_s += cpu_s

    def _admit(self, llm: LLM, running: dict[str, Pending]) -> None:
        engine = llm.llm_engine
        while True:
            try:
                p = self._inbox.get_nowait()
            except queue.Empty:
                return
            request_id = f"loop-{next(self._ids)}"
            # (a cast: under Python 3.10 mypy reads vLLM's TypedDict with every key required)
            prompt = cast("TokensPrompt", {"prompt_token_ids": p.prompt_token_ids})
            try:
                engine.add_request(request_id, prompt, p.params)
            except Exception as e:  # a bad request fails alone
                p.error = e
                p.done.set()
                continue
            p.request_id = request_id
            running[request_id] = p

    def _cancel(self, llm: LLM, running: dict[str, Pending]) -> None:
        while True:
            try:
                p = self._cancels.get_nowait()
            except queue.Empty:
                return
            if p.request_id is None or running.pop(p.request_id, None) is None:
                continue  # finished (or failed) first
            llm.llm_engine.abort_request([p.request_id])
            p.error = RequestCancelled(f"request {p.request_id} cancelled")
            p.done.set()

    def _step(self, llm: LLM, running: dict[str, Pending]) -> None:
        from raykv.integrations.vllm.engines import RequestOutput

        try:
            outputs = llm.llm_engine.step()
        except Exception as e:  # the engine is broken: every request in it fails
            for failed in running.values():
                failed.error = e
                failed.done.set()
            running.clear()
            return
        now = time.perf_counter()
        for out in outputs:
            p = running.get(out.request_id)
            if p is None or not isinstance(out, RequestOutput):  # generate requests only
                continue
            if p.first_token is None and out.outputs and out.outputs[0].token_ids:
                p.first_token = now
            if out.finished:
                p.finished = now
                p.output = out
                del running[out.request_id]
                p.done.set()

    def _has_offload_work(self, llm: LLM) -> bool:
        core = getattr(llm.llm_engine.engine_core, "engine_core", None)
        if core is None:  # engine in its own process: its busy loop steps it
            return False
        return bool(core.scheduler.has_requests())
