"""AsyncLLM: the online engine. Many concurrent callers, one engine loop, async streams of outputs.

The blocking ``LLMEngine.step()`` runs in one dedicated engine thread, so the event loop (the
HTTP server) stays responsive while the model runs. That thread is the only one that touches the
engine, from its construction on (see ``AsyncLLM.__init__``): callers do not add or abort
requests directly, they queue commands that the engine thread applies between steps. The loop
steps while any request is unfinished and sleeps (blocked on the command queue) when idle. Each
step's outputs go back to the callers' event loops through ``call_soon_threadsafe``, one asyncio
queue per request.

Invariants:
- a request's stream ends with exactly one finished output, or with an exception;
- a caller that stops iterating (client disconnect, task cancelled) aborts its request, so its
  blocks are freed in the engine thread's next round;
- if the engine thread dies, every pending caller gets ``EngineDeadError``, new calls get it at
  once, and ``errored``/``check_health`` report it (the server's /health reads them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.engine.async_messages import (
    SHUTDOWN,
    AbortCommand,
    AddCommand,
    CallCommand,
    RequestStream,
)
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.errors import EngineDeadError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora import LoRARequest
from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.multimodal import prompt_with_images
from pagedserve.engine.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.models import load_tokenizer


class AsyncLLM:
    """An LLMEngine driven by a background thread, with ``generate`` as an async iterator."""

    def __init__(self, args: EngineArgs) -> None:
        """Build the engine on the engine thread itself and wait for it (its errors raise here).

        On a CPU, every thread that runs a parallel torch op becomes the master of an OpenMP
        thread pool of its own. A model loaded on the caller's thread and then stepped on the
        engine thread leaves two pools, more OpenMP threads than cores, and libgomp then all but
        stops spin-waiting: every parallel op pays a futex wake-up of its workers, and a decode
        step at batch 1 ran ~2x slower than the same engine stepped where it was built. So all of
        the engine's torch work (load, warm-up, steps) happens on one thread."""
        self.dead_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams, dead_error, _closed and queueing
        self._closed = False
        built: concurrent.futures.Future = concurrent.futures.Future()
        # the thread that builds and steps the engine: all its torch work stays there
        self.engine_thread = threading.Thread(
            target=self._engine_thread, args=(args, built), name="pagedserve-engine", daemon=True
        )
        self.engine_thread.start()
        built.result()  # the engine, or the error that stopped its construction
        # A tokenizer of its own for callers: the engine thread detokenizes concurrently, and a
        # fast tokenizer must not be encoded in one thread while it decodes in another.
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.model_config = self.engine.model_config
        self.scheduler_config = self.engine.scheduler_config
        self.cache_config = self.engine.cache_config
        self.lora_enabled = self.engine.lora_manager is not None
        self.args, self.image_placeholder = args, self.engine.image_placeholder  # client.py
        processor = self.engine.image_processor
        self.max_image_tokens = processor.max_image_tokens if processor is not None else 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(args)

    # ---- state ---------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True while the engine accepts requests."""
        return not self._closed and self.dead_error is None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}") from self.dead_error

    def get_stats(self, drain: bool = True) -> EngineStats:
        """Gauges, cumulative counters and (drained) finished-request latencies, for /metrics."""
        return self.engine.get_stats(drain)

    # ---- requests ------------------------------------------------------------------------

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        multi_modal_data: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request, as ``sampling_params.output_kind`` asks (cumulative
        snapshots, deltas, or the final output only); the last has ``finished=True``. Invalid
        requests raise ``InvalidRequestError`` (naming the field at fault), a full queue
        ``SchedulerOverloadedError``, from the first ``__anext__``, before anything is yielded.
        """
        delta = sampling_params.output_kind is RequestOutputKind.DELTA
        command = AddCommand(
            request_id, list(prompt_token_ids), sampling_params, prompt, priority,
            time.monotonic(), concurrent.futures.Future(), lora_request, None, multi_modal_data,
        )  # fmt: skip
        return self._stream(command, delta)

    def encode(
        self,
        prompt_token_ids: list[int],
        pooling_params: PoolingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        token_type_ids: list[int] | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request's one output (vLLM's ``AsyncLLM.encode``): an embedding, class
        probabilities or a score, as ``pooling_params`` and the model say. Refusals raise
        from the first ``__anext__``, as ``generate``'s."""
        command = AddCommand(
            request_id, list(prompt_token_ids), pooling_params, prompt, priority,
            time.monotonic(), concurrent.futures.Future(), token_type_ids=token_type_ids,
        )  # fmt: skip
        return self._stream(command)

    async def _stream(
        self, command: AddCommand, delta: bool = False
    ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Submit ``command`` and yield its request's outputs until the finished one
        (``delta``: they are deltas, merged when the consumer falls behind)."""
        request_id, done = command.request_id, command.done
        if command.multi_modal_data is not None:  # resized and hashed here, not between steps
            command.prompt_token_ids, command.images = await asyncio.to_thread(
                prompt_with_images, self.engine.image_processor, self.args.model,
                command.prompt_token_ids, command.multi_modal_data,
            )  # fmt: skip
        stream = RequestStream(asyncio.get_running_loop(), delta)
        self._register_and_submit(request_id, stream, command)
        finished = False
        try:
            # shield: a cancelled caller must not cancel ``done`` itself, or the engine thread's
            # set_result raises InvalidStateError and kills the loop (the finally aborts instead).
            # A shield cancelled first drops ``accepted``: it reads itself, or a late refusal is
            # logged "never retrieved" by the garbage collector.
            accepted = asyncio.wrap_future(done)
            accepted.add_done_callback(lambda future: future.cancelled() or future.exception())
            await asyncio.shield(accepted)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
            # Abort unless the engine refused the request (its id may belong to another one).
            # Read ``done`` itself, not whether this loop has seen it yet: the engine thread can
            # accept the request just as the caller is cancelled.
            rejected = done.done() and done.exception() is not None
            if not finished and not rejected:
                self._submit(AbortCommand([request_id]))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter while requests run: its files are read and checked in a worker
        thread (on a CPU, on the engine thread between steps: see ``__init__``), then it is
        registered between two steps. Raises ``InvalidRequestError``."""
        manager = self.engine.lora_manager
        if manager is None:
            self.engine.add_lora(lora_request)  # raises: LoRA is not enabled
        if self.engine.runner.device.type == "cpu":  # torch on one thread (see __init__)
            weights = await self._call(lambda engine: manager.read(lora_request))
        else:
            weights = await asyncio.to_thread(manager.read, lora_request)
        await self._call(lambda engine: engine.add_lora(lora_request, weights))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter: no new request may use it; its in-flight requests finish."""
        return await self._call(lambda engine: engine.remove_lora(lora_int_id))

    async def list_loras(self) -> list[LoRARequest]:
        return await self._call(lambda engine: engine.list_loras())

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_unavailable()
            self._commands.put(CallCommand(fn, done))
        return await asyncio.wrap_future(done)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a finished output (finish_reason "abort")."""
        self._submit(AbortCommand([request_id]))

    async def shutdown(self) -> None:
        """Stop the engine loop; requests still pending end with EngineDeadError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self.engine_thread
            self._commands.put(SHUTDOWN)
        if thread is not None:
            await asyncio.to_thread(thread.join)
        await asyncio.to_thread(self.engine.shutdown)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # ---- caller side ---------------------------------------------------------------------

    def _register_and_submit(self, request_id: str, stream: RequestStream, command) -> None:
        with self._lock:
            self._raise_if_unavailable()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.put(command)

    def _submit(self, command) -> None:
        with self._lock:
            if self._closed or self.dead_error is not None:
                return  # nothing to abort: the loop is gone
            self._commands.put(command)

    def _raise_if_unavailable(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop died: {self.dead_error!r}") from self.dead_error
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    # ---- engine thread -------------------------------------------------------------------

    def _engine_thread(self, args: EngineArgs, built: concurrent.futures.Future) -> None:
        """The engine thread's whole life: build the engine, then run its loop."""
        try:
            self.engine = LLMEngine(args)
        except BaseException as error:  # noqa: BLE001 - raised again by __init__
            built.set_exception(error)
            return
        built.set_result(None)
        self._engine_loop()

    def _engine_loop(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self._fail_requests(self.engine.take_request_errors())
            self._deliver(self.engine.abort_request(self.engine.unfinished_request_ids()))
        except BaseException as error:  # noqa: BLE001 - any failure kills the loop, loudly
            self._die(error)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; wait for one if ``block``. False means shut down."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is SHUTDOWN:
                return False
            if isinstance(command, AbortCommand):
                self._deliver(self.engine.abort_request(command.request_ids))
            elif isinstance(command, CallCommand):
                try:
                    command.done.set_result(command.fn(self.engine))
                except Exception as error:  # a refused adapter, not an engine failure
                    command.done.set_exception(error)
            else:
                self._add(command)

    def _add(self, command: AddCommand) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                prompt=command.prompt,
                arrival_time=command.arrival_time,
                priority=command.priority,
                lora_request=command.lora_request,
                token_type_ids=command.token_type_ids,
                images=command.images,
            )
        except Exception as error:  # a rejected request, not an engine failure
            command.done.set_exception(error)
        else:
            command.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                stream.put(output)

    def _fail_requests(self, errors: list[tuple[str, BaseException]]) -> None:
        """Requests the engine failed on their own (a grammar that did not compile): each
        stream raises its error, before it has yielded anything."""
        with self._lock:
            streams = [(self._streams.pop(rid, None), error) for rid, error in errors]
        for stream, error in streams:
            if stream is not None:
                stream.put(error)

    def _die(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine loop died: {error!r}")
        dead.__cause__ = error
        with self._lock:
            self.dead_error = error
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for command in pending:
            if isinstance(command, AddCommand) and not command.done.done():
                command.done.set_exception(dead)
        self._fail_all(dead)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(error)
