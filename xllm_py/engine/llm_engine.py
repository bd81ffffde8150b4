"""LLMEngine: the engine loop. Owns the scheduler, the model runner and the sampler.

A MIX request: submit (any thread) -> command queue -> add: n/best_of sequences -> step:
schedule -> forward -> sample (and verify guesses: spec_decode/) -> update_from_output ->
output processor -> RequestOutput to its sink. Only the engine thread touches the
scheduler; others use `submit`, `abort`, `call` and the KV connector (remote_kv.py).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from xllm_py.config import EngineConfig, InstanceRole
from xllm_py.engine.engine_request import (  # noqa: F401 - EngineRequest is imported from here
    EngineRequest, admit, error_output, resolve_model_dir)
from xllm_py.engine.grammars import EngineGrammars
from xllm_py.engine.kv_connector import KVConnector
from xllm_py.engine.kv_tiering_setup import build_tiering
from xllm_py.engine.output_processor import OutputProcessor, parent_of
from xllm_py.engine.remote_kv import RemoteKV
from xllm_py.engine.scheduler import ContinuousScheduler
from xllm_py.engine.spec_decode.speculator import Speculator
from xllm_py.engine.spec_decode.verify import sample_step
from xllm_py.engine.step_observers import StepObserver, StepRecord, StepStats
from xllm_py.engine.step_trace import StepTrace
from xllm_py.request import Request, RequestStatus

if TYPE_CHECKING:  # (torch: imported by model_setup, not with the engine loop)
    import torch

    from xllm_py.cluster.latency_profile import LatencyProfile
    from xllm_py.engine.model_setup import LoadedModel
    from xllm_py.engine.sampler import SamplingRow
    from xllm_py.engine.self_profile import ProfileCorrector


logger = logging.getLogger(__name__)

# Requests reaching an idle engine less than this apart start as one batch (_gather_burst).
BURST_GAP_S = 0.005


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """The engine over `loaded` (None: loaded here, model_setup.load_model)."""
        self.config = config
        t0 = time.monotonic()
        if loaded is None:
            from xllm_py.engine.model_setup import load_model

            loaded = load_model(config)
        self.model_dir, self.model, self.model_config = (
            loaded.model_dir, loaded.model, loaded.model_config)
        self.tokenizer, self.storage, self.kv_groups = loaded.tokenizer, loaded.storage, loaded.kv_groups
        self.runner, self.sampler = loaded.runner, loaded.sampler
        self.tp = loaded.tp  # TP > 1: the other ranks, behind self.model (xllm_py/parallel/)
        self.step_clock = loaded.step_clock
        # The profile the instance registers (self_profile.py; None: none) and, where it
        # was measured here, what corrects it.
        self.latency_profile: LatencyProfile | None = None
        self.profile_corrector: ProfileCorrector | None = None
        mc, num_blocks, groups = self.model_config, loaded.num_blocks, self.kv_groups
        max_len = min(config.scheduler.max_model_len, mc.max_position_embeddings)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=max_len)
        # (a Speculator even without a method: requests with a prediction guess from it)
        self.speculator = None if config.simulate else Speculator(
            config.speculative, lambda: self.latency_profile)
        self.scheduler = ContinuousScheduler(
            sched_cfg, config.cache, num_blocks, group_windows=groups.group_windows if groups else (0,),
            speculator=self.speculator)
        # The scheduler caps the context at what the KV pool can hold for one request.
        self.max_model_len = self.scheduler.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = list(dict.fromkeys(
            list(mc.eos_token_ids or []) + list(self.tokenizer.eos_token_ids or [])))
        self.grammars = EngineGrammars(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Ids submitted through try_submit that the engine thread has not added yet.
        self._submit_lock = threading.Lock()
        self._admitting: set[str] = set()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        # Hooks run on the engine thread at the end of every turn of its loop (e.g. flush
        # Generations); step observers (step_observers.py) after every step that computed.
        self.step_listeners: list[Callable[[], None]] = []
        self.step_stats = StepStats()
        self.step_trace = StepTrace(config.step_trace) if config.step_trace else None
        self.step_observers: list[StepObserver] = [self.step_stats, *filter(None, [
            self.step_trace, self.speculator and self.speculator.step_cost])]
        # The KV connector (kv_connector.py; PD: pd/connector.py), polled every turn of
        # the loop; a PREFILL's hands every request over at its first token.
        self.role = config.role
        self.connector = KVConnector()
        self.remote_kv = RemoteKV(self)
        self.num_step_failures = 0  # steps that raised (their requests failed with them)
        self.num_generated_tokens = 0
        self.recent_max_ttft_ms = 0.0
        # The KV tiers below the pool (kv_tiering.py).
        self.tiering = None if groups is None else build_tiering(
            config, self.model_dir, self.storage, self.scheduler.kv, self.wake)
        if self.tiering is not None:
            self.step_listeners.append(self.tiering.flush_offloads)
        logger.info("engine ready: model %s, %d layers, %d KV blocks of %d tokens, loaded in %.2fs",
                    self.model_dir, mc.num_layers, num_blocks, config.cache.block_size, time.monotonic() - t0)

    @property
    def num_steps(self) -> int:
        return self.step_stats.num_steps

    @property
    def recent_max_tbt_ms(self) -> float:
        return self.step_stats.recent_max_ms

    def set_latency_profile(self, profile: LatencyProfile | None,
                            corrector: ProfileCorrector | None = None) -> None:
        """The profile this instance registers (self_profile.py); a `corrector` (a measured
        profile's) observes every step from now on. Before the engine thread starts, or
        from the thread that registers the profile (a reference swap)."""
        self.latency_profile = profile
        if corrector is not None and self.profile_corrector is None:
            self.profile_corrector = corrector
            self.step_observers.append(corrector)

    # ------------------------------------------------------------------ threading
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="xllm-engine", daemon=True)
        self._thread.start()

    def run_here(self) -> None:
        """Run the engine loop in the calling thread (the one that built the engine: see
        server.start_engine_thread) until `stop()`."""
        self._thread = threading.current_thread()
        self._run()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.tp is not None:
            self.tp.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()
        if self.tiering is not None:
            self.tiering.close()
        self.grammars.close()

    def submit(self, req: EngineRequest) -> None:
        self._commands.put(("add", req))

    def try_submit(self, req: EngineRequest) -> bool:
        """Submit unless a request of this id is queued or in flight here (any thread).
        False: a duplicate, nothing submitted (its sink would be the first one's)."""
        rid = req.request_id
        with self._submit_lock:
            if rid in self._admitting or rid in self.outputs:
                return False
            self._admitting.add(rid)
        self._commands.put(("add", req))
        return True

    @property
    def num_queued_commands(self) -> int:
        """Submissions, aborts and calls the engine thread has not run yet."""
        return self._commands.qsize()

    def abort(self, parent_id: str) -> None:
        self._commands.put(("abort", parent_id))

    def abort_all(self, message: str) -> None:
        """End every request now with an error (`message`), freeing its blocks."""
        self.call(lambda: self._fail_all_running(message))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the engine thread; returns a future with its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, fut)))
        return fut

    def wake(self) -> None:
        """Make the engine thread poll its connector now (any thread)."""
        self._commands.put(("wake", None))

    def set_connector(self, connector: KVConnector) -> None:
        """Install the KV connector (before requests arrive). One that hands requests over
        (`hands_over`: a PD prefill, or an elastic MIX) ends each request submitted with
        `remote_decode` at its first sampled token, its KV held (SENDING_KV) until the
        connector's SendDone; raises ValueError on a DECODE."""
        if connector.hands_over and self.role == InstanceRole.DECODE:
            raise ValueError("a DECODE engine hands no request over")
        self.connector = connector

    @property
    def step_budget_tokens(self) -> int:
        """Tokens a step may compute (max_num_batched_tokens, as the profile set it)."""
        return self.scheduler.config.max_num_batched_tokens

    @property
    def num_not_started(self) -> int:
        """Requests waiting for their first step, and commands not run yet (any thread)."""
        return self.scheduler.num_waiting + self.num_queued_commands

    def handover_block_ids(self, tables: list[list[int]], num_cached: int,
                           num_prompt: int) -> list[int]:
        """The blocks a PD decode lacks (KVCacheManager.handover_block_ids; pure)."""
        return self.scheduler.kv.handover_block_ids(tables, num_cached, num_prompt)

    def handover_group_sizes(self, num_cached: int, num_prompt: int) -> tuple[int, ...]:
        """Per KV group, its share of handover_block_ids' blocks (KVMove.group_blocks)."""
        return tuple(self.scheduler.kv.handover_group_sizes(num_cached, num_prompt))

    def _run(self) -> None:
        while not self._stopped.is_set():
            idle = not self.scheduler.has_schedulable_requests()
            self._drain_commands(0.5 if idle else None)
            if self.tiering is not None:
                self.tiering.poll()
            if idle and self.scheduler.has_schedulable_requests():
                self._gather_burst()
            if self._stopped.is_set():
                break
            if self.scheduler.has_schedulable_requests():
                try:
                    self.step()
                except Exception:
                    self.num_step_failures += 1
                    logger.exception("engine step failed; failing the requests of this step")
                    self._fail_all_running("engine step failed")
            for listener in self.step_listeners:
                try:
                    listener()
                except Exception:
                    logger.exception("step listener failed")

    def _gather_burst(self) -> None:
        """Work came to an idle engine: take what follows less than BURST_GAP_S apart, for
        up to the batch window or until a step's budget is waiting, so that a burst (sent
        and parsed one request at a time) starts as one batch, not as two prefills."""
        deadline = time.monotonic() + self.config.scheduler.batch_window_ms / 1000
        while not self._stopped.is_set() and not self.scheduler.waiting_fills_a_step():
            left = deadline - time.monotonic()
            if left <= 0 or not self._drain_commands(min(BURST_GAP_S, left)):
                return

    def _drain_commands(self, timeout: float | None) -> bool:
        """Run the connector's events and the queued commands, after waiting up to
        ``timeout`` s for the first command (None: do not wait). Returns whether any ran."""
        polled = self.remote_kv.poll()
        try:
            cmd = self._commands.get(timeout=timeout) if timeout and not polled else (
                self._commands.get_nowait())
        except queue.Empty:
            return polled
        while True:
            kind, arg = cmd
            try:
                if kind == "add":
                    self._add(arg)
                elif kind == "add_compiled":  # its grammar compiled meanwhile
                    if self.grammars.take_deferred(arg.request_id):
                        self._add(arg)
                elif kind == "abort":
                    self._abort(arg)
                elif kind == "call":
                    fn, fut = arg
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as exc:  # delivered to the caller
                            fut.set_exception(exc)
            except Exception:
                logger.exception("engine command %s failed", kind)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                self.remote_kv.poll()  # (what a "wake" came for)
                return True

    # ------------------------------------------------------------------ requests
    def _add(self, req: EngineRequest) -> None:
        if self.grammars.defer(req, lambda r: self._commands.put(("add_compiled", r))):
            return  # back as "add_compiled" once a worker thread compiled its grammar
        try:
            if req.request_id in self.outputs:
                requests: list[Request] | str = f"duplicate request id {req.request_id}"
            else:
                requests = self.admit(req)
                if not isinstance(requests, str) and req.params.structured is not None:
                    requests = self.grammars.attach_new(requests, req, self.outputs)
        except Exception as exc:  # a check admit lacks: refuse this request only
            logger.exception("admitting request %s failed", req.request_id)
            self.outputs.drop_parent(req.request_id)
            requests = f"request refused ({type(exc).__name__})"
        finally:
            with self._submit_lock:
                self._admitting.discard(req.request_id)
        if isinstance(requests, str):  # it would fail the whole step it joined
            req.sink.emit(error_output(req, 400, requests))
            return
        for request in requests:
            self.scheduler.add_request(request)
            if self.tiering is not None:
                self.tiering.prefetch(request)

    def admit(self, req: EngineRequest,
              limit_what: str = "this model's context is {} tokens") -> list[Request] | str:
        """The one intake of a request (engine_request.admit): its sequences as Requests
        for the scheduler, its outputs registered; or why it is refused."""
        return admit(req, self.outputs, self.eos_token_ids, self.model_config.vocab_size,
                     self.max_model_len, limit_what)

    def _abort(self, parent_id: str) -> None:
        if self.grammars.drop_deferred(parent_id):
            with self._submit_lock:
                self._admitting.discard(parent_id)
        for cid in self.outputs.child_ids(parent_id):
            self.scheduler.abort_request(cid)
        self.outputs.drop_parent(parent_id)

    def _fail_all_running(self, message: str) -> None:
        for rid in list(self.scheduler.requests):
            parent_id, _ = parent_of(rid)
            self.scheduler.abort_request(rid, RequestStatus.FINISHED_ERROR)
            self.outputs.fail_parent(parent_id, 500, message)

    # ------------------------------------------------------------------ the step
    def step(self) -> None:
        c0 = self.step_clock()
        sched_out = self.scheduler.schedule()
        seqs = sched_out.seqs
        if not seqs:
            return
        t0 = time.monotonic()
        if sched_out.loads:  # (prefixes from the KV tiers: into the pool first)
            self.tiering.scatter(sched_out.loads)
        step_logits = self.runner.execute_step(seqs)
        for i, rows in step_logits.prompt:
            self._record_prompt_logprobs(seqs[i], rows)
        picked = sample_step(seqs, step_logits, self.scheduler.requests, self.sampler,
                             self.grammars, self._sampling_row)  # (and verify guesses)
        updates = self.scheduler.update_from_output(sched_out, picked.sampled, picked.accepted)
        self.grammars.advance(updates, self.scheduler)
        if self.tiering is not None:  # (finished requests' blocks go back before their outputs)
            self.tiering.flush_offloads()
        step_ms = (time.monotonic() - t0) * 1000
        num_waiting = len(self.scheduler.waiting)
        self._process_updates(updates, picked.logprobs)
        record = StepRecord(sched_out, t0, step_ms, (self.step_clock() - c0) * 1000,
                            num_waiting, self.scheduler.tpot_guard)
        for observer in self.step_observers:
            try:
                observer.on_step(record)
            except Exception:  # (the step is done: its requests are not failed for this)
                logger.exception("step observer %s failed", type(observer).__name__)

    def _record_prompt_logprobs(self, seq, logits: torch.Tensor) -> None:
        """Logits rows at positions start_pos.. of a prefill chunk score the prompt tokens
        after them (float32 log_softmax of the raw logits, no bias or penalty)."""
        from xllm_py.engine.sampler import prompt_logprobs

        request = self.scheduler.requests[seq.request_id]
        first = seq.start_pos + 1
        targets = request.prompt_token_ids[first:first + logits.shape[0]]
        entries = prompt_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        self.outputs.add_prompt_logprobs(seq.request_id, first, entries)

    def _process_updates(self, updates, logprobs: dict[str, Any]) -> None:
        by_parent: dict[str, list] = {}
        handovers = []
        for upd in updates:
            try:
                self._process_update(upd, logprobs, by_parent, handovers)
            except Exception:
                logger.exception("output processing of request %s failed", upd.request_id)
                parent_id, _ = parent_of(upd.request_id)
                self.scheduler.abort_request(upd.request_id, RequestStatus.FINISHED_ERROR)
                self.outputs.fail_parent(parent_id, 500, "output processing failed")
        for parent_id, deltas in by_parent.items():
            if parent_id in self.outputs:
                ttft = self.outputs.emit_step(deltas, parent_id)
                if ttft is not None:
                    self.recent_max_ttft_ms = max(self.recent_max_ttft_ms * 0.98, ttft * 1000)
        for upd, delta, tables, parent_id in handovers:
            self.outputs.drop_parent(parent_id)
            self.connector.request_finished(upd, delta, tables)

    def _process_update(self, upd, logprobs: dict[str, Any], by_parent: dict[str, list],
                        handovers: list) -> None:
        self.num_generated_tokens += len(upd.new_token_ids)
        lps = logprobs.get(upd.request_id)  # (one per token picked: the first emitted)
        parent_id, _ = parent_of(upd.request_id)
        request = self.scheduler.requests.get(upd.request_id)  # (None once it finished)
        self.outputs.set_usage(parent_id, upd.num_cached_tokens, upd.predicted)
        # PD prefill: the request goes on on the decode peer, not finished for the client.
        finish_reason = None if upd.kv_held else upd.finish_reason
        delta = self.outputs.process(
            upd.request_id, upd.new_token_ids, lps[:len(upd.new_token_ids)] if lps else None,
            finish_reason, upd.stop_reason, self._finish_by_stop_string)
        if delta is not None:
            by_parent.setdefault(parent_id, []).append(delta)
        if upd.remote_decode and self.connector.hands_over:  # a PD prompt's first token
            tables = [list(t) for t in self.scheduler.kv.tables(request)] if request else [[]]
            handovers.append((upd, delta, tables, parent_id))

    def _finish_by_stop_string(self, request_id: str, stop_str: str) -> None:
        request = self.scheduler.get_request(request_id)
        if request is None or request.status == RequestStatus.SENDING_KV:
            return  # PD prefill: the hand-over sees the stop and releases the KV itself
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_str)

    def _sampling_row(self, request: Request) -> SamplingRow:
        """The request's sampler row (sampler.request_row; a simulated engine has none)."""
        from xllm_py.engine.sampler import request_row

        return request_row(request)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, float]:
        pool = self.scheduler.kv.block_pool
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_used": pool.num_used_blocks - self.scheduler.kv.num_held_for_offload(),
            "kv_blocks_total": pool.num_usable_blocks,
            "prefix_hit_tokens": pool.num_prefix_hit_tokens,
            "generated_tokens": self.num_generated_tokens,
            "step_failures": self.num_step_failures,
            "prompt_steps_held": guard.num_held if (guard := self.scheduler.tpot_guard) else 0,
            "offline_waiting": self.scheduler.offline.num_waiting,
            "offline_running": self.scheduler.offline.num_running,
            "offline_preempted": self.scheduler.offline.num_preempted,
            "offline_preemptions": self.scheduler.offline.num_preemptions,
            "offline_suspensions": self.scheduler.offline.num_suspensions,
        }

