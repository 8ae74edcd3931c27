"""The tensor-parallel runtime: the driver (the engine's process, rank 0) and the worker ranks.

::

    driver (rank 0: scheduler, sampler, finish step)          worker rank r (r = 1 .. N-1)
      Engine.step -> Engine.forward(batch)                       loop:
        KvMirror: the step's KV calls, logged ─── pipe ──>          replay the KV calls (same results,
        (reserve, adopt_prefix, prepare, commit, free, ...)         same block tables: checked)
        shard forward ──── all-reduce / all-gather ─────────────    shard forward (the same collectives)
        logits [R, V]  <── gather of the vocabulary shards ─────    (no logits kept)

The control plane is one pipe per worker carrying each step's KV calls and batch (as vLLM's
multiprocess executor broadcasts its scheduler output over a shared-memory queue, not over the
model's process group); the data plane is ``torch.distributed`` (:mod:`monobatch.distributed.comm`).
Every rank's KV store is the same kind, sized to the same number of blocks, and receives the same
calls in the same order, so its block manager makes the same decisions: block ids agree on every
rank (each step's block tables are compared on the workers). A worker waits for the next step
without a timeout (an idle server is not an error); a step's collectives time out. A rank that
dies ends the engine with :class:`TensorParallelError` naming it, at the next collective (gloo
sees the connection reset at once) or at the next step (its process has exited).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from monobatch import env
from monobatch.batch import StepBatch
from monobatch.distributed.comm import TpGroup, free_port, timeout_s
from monobatch.distributed.plan import TensorParallelPlan
from monobatch.distributed.sharding import attach, shard_model
from monobatch.errors import MonobatchError
from monobatch.kernels import invariant_gemm
from monobatch.kv.dense import DenseKv
from monobatch.kv.paged import PagedKv
from monobatch.kv.store import KvStore
from monobatch.models.layers import DecoderModel

log = logging.getLogger(__name__)

#: KvStore calls that change its state: logged on the driver, replayed on every worker.
MIRRORED = ("reserve", "adopt_prefix", "prepare", "commit", "trim", "fork", "free", "clear_prefix_cache")


class TensorParallelError(MonobatchError):
    """A rank died, a collective failed or timed out, or the ranks' KV state diverged: the
    engine cannot continue."""


class KvMirror:
    """The driver's KV store, logging every call that changes its state (:data:`MIRRORED`) with its
    result; everything else (attend, usage, block_size, ...) goes straight through.

    Args:
        inner: the driver's own store (its rank's heads).
    """

    def __init__(self, inner: KvStore) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "ops", [])

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in MIRRORED:
            return attr

        def logged(*args):
            result = attr(*args)
            self.ops.append((name, args, result))
            return result
        return logged

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def take(self) -> list[tuple[str, tuple, Any]]:
        """The calls logged since the last take, oldest first."""
        ops = self.ops
        object.__setattr__(self, "ops", [])
        return ops


@dataclass(slots=True)
class KvSpec:
    """What a worker needs to build its KV store like the driver's (its own heads).

    Attributes:
        paged: paged (else dense) storage.
        num_layers, head_dim, max_seq_len: the store's shape.
        num_blocks, block_size: the paged pool (every rank the same count).
        windows: per layer, its sliding window.
        batch_invariant: :attr:`KvStore.batch_invariant`.
    """

    paged: bool
    num_layers: int
    head_dim: int
    max_seq_len: int
    num_blocks: int
    block_size: int
    windows: tuple[int, ...]
    batch_invariant: bool

    @classmethod
    def of(cls, kv: KvStore) -> "KvSpec":
        """The spec of the driver's store."""
        paged = isinstance(kv, PagedKv)
        return cls(paged, kv.num_layers, kv.head_dim, kv.max_seq_len, kv.scratch_block if paged else 0,
                   kv.block_size or 0, kv.windows, kv.batch_invariant)

    def build(self, kv_heads: int, dtype: torch.dtype, device: torch.device) -> KvStore:
        """A store of ``kv_heads`` heads on ``device``."""
        shape = (self.num_layers, kv_heads, self.head_dim, self.max_seq_len, dtype, device)
        kv = (PagedKv(*shape, num_blocks=self.num_blocks, block_size=self.block_size, windows=self.windows)
              if self.paged else DenseKv(*shape, windows=self.windows))
        kv.batch_invariant = self.batch_invariant
        return kv


@dataclass(slots=True)
class StepMessage:
    """One step for the workers.

    Attributes:
        ops: the driver's KV calls since the last message (name, args, result).
        batch: the step to run (host tensors; the same object as the last ``prepare``'s), or None.
        tables: paged storage: seq id -> its block tables (every group) after ``prepare``.
        scratch: ``(token_ids, all_positions, row_tile)``: a B=1 forward on a scratch dense store
            instead (:meth:`Engine.prompt_logits`).
    """

    ops: list
    batch: StepBatch | None = None
    tables: dict[int, list] | None = None
    scratch: tuple[list[int], bool, int] | None = None


def _to_host(ops: list, batch: StepBatch | None) -> tuple[list, StepBatch | None]:
    """Ops and batch with every StepBatch on the host (one copy per object, so identity holds)."""
    seen: dict[int, StepBatch] = {}

    def host(b):
        if isinstance(b, StepBatch):
            if id(b) not in seen:
                seen[id(b)] = b.to("cpu")
            return seen[id(b)]
        return b
    ops = [(name, tuple(host(a) for a in args), result) for name, args, result in ops]
    return ops, host(batch)


def _tables(kv: KvStore, batch: StepBatch) -> dict[int, list] | None:
    """The block tables of the batch's sequences (paged storage), for the workers' check."""
    if not isinstance(kv, PagedKv):
        return None
    return {c.seq_id: [kv.block_table(c.seq_id, g) for g in range(len(kv.groups))] for c in batch.chunks}


def scratch_forward(model: DecoderModel, kv_heads: int, token_ids: list[int], all_positions: bool,
                    row_tile: int, invariant: bool) -> torch.Tensor:
    """One prompt alone on a scratch dense store of this rank's heads (:meth:`Engine.prompt_logits`):
    ``[1, V]`` or ``[T, V]`` float32 logits on the driver."""
    args = model.args
    scratch = DenseKv(args.num_hidden_layers, kv_heads, args.head_dim, max(len(token_ids), 1), model.dtype,
                      model.device, windows=args.layer_windows())
    batch = StepBatch.build([(0, list(token_ids), 0, True)], model.device, row_tile)
    if all_positions:
        batch.logit_rows = torch.arange(len(token_ids), device=model.device)
    scratch.batch_invariant = invariant
    scratch.prepare(batch)
    return model(batch, scratch)


def _device_context(device: torch.device, invariant: bool):
    """The rank's CUDA device current (when CUDA) and the batch-invariant GEMMs (when on)."""
    stack = contextlib.ExitStack()
    if device.type == "cuda":
        stack.enter_context(torch.cuda.device(device))
    stack.enter_context(invariant_gemm.mode(invariant))
    return stack


class TensorParallelDriver:
    """Rank 0 of a tensor-parallel engine: starts the workers and runs each step's forward on all ranks.

    Args:
        model: the full model (not changed; the workers' shards are cut from it here).
        shard: rank 0's shard (:func:`shard_model`), with its RoPE tables built.
        plan: the ranks' pieces.
        kv: the driver's KV store (rank 0's heads); wrapped in a :class:`KvMirror` (:attr:`kv`).
        pieces: deterministic mode (:func:`shard_model`).
        row_tile, invariant: the engine's numerics (scratch forwards).

    Raises:
        TensorParallelError: a worker failed to start (its error is in the message).
    """

    def __init__(self, model: DecoderModel, shard: DecoderModel, plan: TensorParallelPlan, kv: KvStore,
                 pieces: bool, row_tile: int, invariant: bool) -> None:
        import torch.multiprocessing as mp

        self.plan, self.shard, self.row_tile, self.invariant = plan, shard, row_tile, invariant
        self.kv = KvMirror(kv)
        self.device = shard.device
        self.failed: str | None = None
        port, timeout = free_port(), timeout_s()
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        spec = KvSpec.of(kv)
        parts = []  # kept until every worker has its shard (CUDA IPC: the sender keeps the tensors alive)
        # registered first: a rank that fails to start still gets the ranks before it stopped
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns)
        try:
            for rank in range(1, plan.world):
                part = shard_model(model, plan, rank, pieces, copy_=True)
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, name=f"{env.WORKER_PREFIX}{rank}", daemon=True,
                                   args=(rank, plan, port, part, spec, child, torch.get_num_threads(),
                                         self._worker_device(rank), kv.max_seq_len, timeout))
                proc.start()
                child.close()
                parts.append(part)
                self.procs.append(proc)
                self.conns.append(parent)
            self.group = self._join(port, timeout)
            for rank, conn in enumerate(self.conns, 1):
                if not conn.poll(timeout):
                    raise TensorParallelError(f"tensor parallel rank {rank} did not start within {timeout:.0f} s")
                status, detail = conn.recv()
                if status != "ready":
                    raise TensorParallelError(f"tensor parallel rank {rank} failed to start: {detail}")
        except (RuntimeError, EOFError, OSError) as e:
            self.close()
            raise TensorParallelError(f"tensor parallel start-up failed: {self._who_died() or e}") from e
        except BaseException:  # TensorParallelError, or a shard/spawn failure: no rank left running
            self.close()
            raise
        del parts
        attach(shard, self.group)

    def _join(self, port: int, timeout: float) -> TpGroup:
        """Rank 0's group, built on a thread while the workers are watched: a worker that dies
        before it joins (its arguments failed to load, say) is an error now, not after the timeout."""
        box: dict[str, Any] = {}

        def connect() -> None:
            try:
                box["group"] = TpGroup(0, self.plan.world, port, self.device, timeout)
            except Exception as e:  # noqa: BLE001 - raised below
                box["error"] = e
        thread = threading.Thread(target=connect, name="monobatch-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            for rank, proc in enumerate(self.procs, 1):
                if proc.exitcode is not None:
                    raise TensorParallelError(f"tensor parallel rank {rank} exited during start-up "
                                              f"(exit code {proc.exitcode})")
        if "error" in box:
            raise box["error"]
        return box["group"]

    def _worker_device(self, rank: int) -> str:
        """Rank ``rank``'s device: the next CUDA devices after the driver's, or the CPU."""
        if self.device.type != "cuda":
            return "cpu"
        return f"cuda:{(self.device.index or 0) + rank}"

    def _who_died(self) -> str | None:
        """``rank 1 exited (exit code -9)`` for the first worker that exited, waiting up to 2 s."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for rank, proc in enumerate(self.procs, 1):
                if proc.exitcode is not None:
                    return f"tensor parallel rank {rank} exited (exit code {proc.exitcode})"
            time.sleep(0.05)
        return None

    def _fail(self, err: BaseException) -> TensorParallelError:
        """Stop every rank and say why (the dead rank when one died)."""
        why = self._who_died() or f"a collective failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        self.failed = why
        for proc in self.procs:  # ranks still waiting in a collective would only time out
            if proc.is_alive():
                proc.terminate()
        self.close()
        return TensorParallelError(f"{why}; the tensor-parallel engine cannot continue")

    def _send(self, msg: StepMessage) -> None:
        """The message to every worker (pickled once)."""
        if self.failed:
            raise TensorParallelError(f"{self.failed}; the tensor-parallel engine cannot continue")
        for proc in self.procs:  # a dead rank named now, on any backend (NCCL's wait would not raise)
            if proc.exitcode is not None:
                raise self._fail(EOFError("a worker exited"))
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    @contextlib.contextmanager
    def _step_guard(self) -> Iterator[None]:
        """Around a step sent to the workers: any failure after the send leaves them a collective
        ahead, so every rank is stopped (:meth:`_fail`) and a TensorParallelError raised
        (KeyboardInterrupt and the like propagate as they are, after the stop)."""
        try:
            yield
        except TensorParallelError:
            raise
        except BaseException as e:  # after the send the workers are a collective ahead: stop them all
            err = self._fail(e)
            if not isinstance(e, Exception):  # KeyboardInterrupt and the like go on as they are
                raise
            raise err from e

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Run a prepared step on every rank: ``[R, V]`` float32 logits of ``batch.logit_rows``.

        Raises:
            TensorParallelError: a rank died or a collective failed or timed out.
        """
        with self._step_guard():
            ops, host = _to_host(self.kv.take(), batch)
            self._send(StepMessage(ops, host, _tables(self.kv.inner, batch)))
            return self.shard(batch, self.kv.inner)

    def prompt_logits(self, token_ids: list[int], all_positions: bool) -> torch.Tensor:
        """:func:`scratch_forward` on every rank: the driver's ``[1, V]`` / ``[T, V]`` logits.

        Raises:
            TensorParallelError: as :meth:`forward`.
        """
        with self._step_guard():
            ops, _ = _to_host(self.kv.take(), None)
            self._send(StepMessage(ops, scratch=(list(token_ids), all_positions, self.row_tile)))
            return scratch_forward(self.shard, self.plan.kv_heads(0), token_ids, all_positions, self.row_tile,
                                   self.invariant)

    def close(self) -> None:
        """Stop the workers (a clean exit when they can, else terminated) and drop the group."""
        self._finalizer()
        group = getattr(self, "group", None)
        if group is not None:
            group.close()


def _shutdown(procs: list, conns: list) -> None:
    """Tell every worker to exit, wait a moment, terminate the ones still running."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(pickle.dumps(None))
            conn.close()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)


def worker_main(rank: int, plan: TensorParallelPlan, port: int, shard: DecoderModel, spec: KvSpec, conn,
                threads: int, device: str, max_len: int, timeout: float) -> None:
    """A worker rank's process: join the group, then run each step the driver sends until it
    says stop (None) or its pipe closes (the driver exited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's; a worker ends when its pipe closes
    try:
        torch.set_num_threads(threads)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        group = TpGroup(rank, plan.world, port, dev, timeout)  # joined first: later failures are reported
        if dev.type == "cuda":
            shard = shard.to_device(dev, shard.dtype)  # a copy out of the driver's (CUDA IPC) tensors
        attach(shard, group)
        shard.build_rope_tables(max_len, shard.dtype, grow=dev.type == "cpu")  # as the driver's (Engine)
        kv = spec.build(plan.kv_heads(rank), shard.dtype, dev)
        conn.send(("ready", None))
    except Exception as e:  # noqa: BLE001 - the driver reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    with torch.inference_mode():
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the driver is gone
            msg = pickle.loads(data)
            if msg is None:
                break
            try:
                _run(msg, shard, kv, plan, rank, spec, dev)
            except Exception:  # noqa: BLE001 - this rank is out of step: exit, the driver's collective fails
                traceback.print_exc()
                os._exit(3)
    group.close()


def _run(msg: StepMessage, shard: DecoderModel, kv: KvStore, plan: TensorParallelPlan, rank: int, spec: KvSpec,
         dev: torch.device) -> None:
    """Replay the driver's KV calls, check the block tables, run the step's forward (or scratch forward)."""
    batch = None if msg.batch is None else msg.batch.to(dev)  # the very object prepare() gets
    for name, args, result in msg.ops:
        args = tuple((batch if a is msg.batch else a.to(dev)) if isinstance(a, StepBatch) else a for a in args)
        got = getattr(kv, name)(*args)
        if name in ("reserve", "adopt_prefix") and got != result:
            raise RuntimeError(f"rank {rank}: KV {name}{args[:1]} returned {got}, the driver's {result}")
    with _device_context(dev, spec.batch_invariant):
        if msg.scratch is not None:
            ids, all_positions, row_tile = msg.scratch
            scratch_forward(shard, plan.kv_heads(rank), ids, all_positions, row_tile, spec.batch_invariant)
        elif batch is not None:
            if msg.tables is not None and _tables(kv, batch) != msg.tables:
                raise RuntimeError(f"rank {rank}: block tables differ from the driver's "
                                   f"({_tables(kv, batch)} vs {msg.tables})")
            shard(batch, kv)
