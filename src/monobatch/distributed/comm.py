"""The tensor-parallel process group and the collectives the sharded layers call.

One :class:`TpGroup` per process (rank), over a ``torch.distributed`` process group built on its
own TCP store on 127.0.0.1 (not the global default group, so several engines, and a test's
engines, can live in one process): gloo on CPU, NCCL on CUDA. Every collective waits at most
``timeout``; a rank that died makes gloo's next collective fail at once (its TCP connection
resets), and a stuck one makes it fail after the timeout: never a hang.

A group of one rank (TP=1 in deterministic mode, which runs the same pieces) has no process
group and its collectives are identities.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from monobatch import env

#: Seconds a collective may wait for the other ranks (a step's slowest forward included).
DEFAULT_TIMEOUT_S = 300.0
#: The longest ``MONOBATCH_TP_TIMEOUT`` taken (about 31 years; c10d keeps its timeout in
#: milliseconds, and an infinite or huge value overflowed there).
MAX_TIMEOUT_S = 1e9


def timeout_s() -> float:
    """The collectives' timeout: ``MONOBATCH_TP_TIMEOUT`` seconds, default :data:`DEFAULT_TIMEOUT_S`;
    a value that is not a positive number of seconds (at most :data:`MAX_TIMEOUT_S`) warns once and
    gives the default. The engine reads it in its own process, with or without tensor
    parallelism, and hands it to the worker ranks."""
    return env.number("MONOBATCH_TP_TIMEOUT", DEFAULT_TIMEOUT_S, parse=float,
                      check=lambda v: 0 < v <= MAX_TIMEOUT_S, what="a positive number of seconds")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TpGroup:
    """This process's rank in the tensor-parallel group.

    Args:
        rank, world: this rank and the group size.
        port: the rendezvous port on 127.0.0.1 (rank 0 hosts the store); unused when world is 1.
        device: the rank's device (NCCL when CUDA, gloo otherwise).
        timeout_s: the collectives' timeout, seconds.

    Raises:
        RuntimeError: the rendezvous failed (a rank did not join within the timeout).
    """

    def __init__(self, rank: int, world: int, port: int = 0, device: torch.device | str = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.pg = None
        if world == 1:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout, wait_for_workers=False)
        prefix = dist.PrefixStore("monobatch-tp", self.store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefix, rank, world, timeout)

    @property
    def is_driver(self) -> bool:
        """Rank 0, the engine's own process."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (any shape and dtype); returns ``x``."""
        if self.pg is not None:
            self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on every rank), in rank order."""
        if self.pg is None:
            return [x]
        outs = [torch.empty_like(x) for _ in range(self.world)]
        self.pg.allgather([outs], [x.contiguous()]).wait()
        return outs

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` on the driver, in rank order (None on the other ranks)."""
        if self.pg is None:
            return [x]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [torch.empty_like(x) for _ in range(self.world)] if self.is_driver else []
        self.pg.gather([outs] if self.is_driver else [], [x.contiguous()], opts).wait()
        return outs if self.is_driver else None

    def close(self) -> None:
        """Drop the process group (its connections close)."""
        self.pg = None
        self.store = None
