"""Data-parallel learners and critics: the K replicas of a role as one ``torch.distributed`` group.

With ``roles.<learner>.replicas: K`` (and ``supervision.strategy: one_for_all``, so the group
restarts together), every rank receives the whole ``TrainBatch`` (replica 0 takes it from the
caller and announces it to the others: ``asyncrl.roles.training.lockstep``, the critic's way
too) and does everything that is cheap identically: the ledger's filter, the advantages over the
whole batch (whitening included), the seeded mini-batch shuffle. The forward and backward passes
are shared out: each mini-batch's samples are split between the ranks by ``token_shares`` (a
deterministic partition balanced by token count, the same on every rank), each rank weighs its
micro-batches by the mini-batch's *global* aggregate, and the gradients are summed over the ranks
(``all_reduce_grads``) before clipping and the optimizer step. So K learners take the step one
learner takes on the whole batch (to float rounding: the sums are added in another order), and
their parameters stay bit-identical (the same reduced gradients meet the same optimizer).

The group is formed in the role's compute thread, never on its event loop (``join``):

- with ``ASYNCRL_DIST_STORE=HOST:PORT`` (set by a multi-node launch: torchrun's TCPStore), every
  rank connects to that store as a client, under the key prefix
  ``{ASYNCRL_DIST_PREFIX}/{role}/{generation}``, or ``{ASYNCRL_DIST_PREFIX}/{role}/members-0-2/
  {generation}`` once the group went on at a smaller size (``ctx.members``: the replicas left
  after a node's loss, docs/multinode.md), so that the group at its old size and at its new
  one never meet;
- otherwise through a ``FileStore`` in ``RUN_DIR/dist/``, named by the role, the node agent's
  process id and the generation, so a file from an earlier run or attempt is never read.

On one node the generation is the replica's incarnation: under ``one_for_all`` one supervisor
restarts every replica of the group together, so their incarnations move in step. Across nodes
each node's agent restarts its own replicas, and a rank that crashed before it joined has a higher
incarnation than its peers; there the generation is how many times this rank joined before, counted
in the store (``joins/<rank>``). A rank that dies makes the others' next collective fail, they
leave and join again, so every rank's count moves by one per group restart. A rank that never
arrives ends the wait after ``timeout_s`` with a ``DataParallelError`` naming the group and the
missing ranks.

The collectives go through the hardware plugin's communication part (``plugin.comm``:
all-reduce, all-gather, barrier), each bounded by the same ``timeout_s`` (the learner's
``dist_timeout_s`` in the manifest); one that does not complete in time fails with the plugin's
``CollectiveTimeoutError`` (naming the collective and the ranks that did not arrive) as the
``DataParallelError``'s cause.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # re-exported from C10d
    FileStore,
    PrefixStore,
    TCPStore,
)

from asyncrl.errors import AsyncrlError
from asyncrl.plugins.contract import Communication
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.role import RoleContext
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import micro_batches
from asyncrl.roles.payloads import Scored
from asyncrl.roles.training.checkpoints import CheckpointDir, CheckpointError

__all__ = [
    "GLOBAL_METRICS",
    "GROUP_HINT",
    "NONE_LOADABLE",
    "PREFIX_ENV",
    "STORE_ENV",
    "DataParallel",
    "DataParallelError",
    "agree_checkpoint",
    "check_restored",
    "fingerprint",
    "join_role",
    "rank_chunks",
    "share_out",
    "state_checksum",
    "token_shares",
]

STORE_ENV = "ASYNCRL_DIST_STORE"
"""``HOST:PORT`` of a TCPStore already serving (torchrun's); unset: a FileStore in the run dir."""
PREFIX_ENV = "ASYNCRL_DIST_PREFIX"
"""The key prefix of this run's attempt in that store (run id and restart count)."""

GROUP_HINT = (
    "every rank must run every call replica 0 announces (LearnerClient and CriticClient send "
    "their calls to replica 0; a call sent to another replica is refused)"
)
"""What a failed collective of a learner's or critic's group says to check."""

GLOBAL_METRICS = ("grad_norm", "lr")
"""Step metrics every rank computes from the reduced gradients: the same on every rank, so they
are taken as they are, never summed."""


class DataParallelError(AsyncrlError):
    """The replicas of a data-parallel learner could not work as one group: a rank never arrived,
    a collective did not complete, or the ranks disagree (another batch, step or state).

    Recoverable: the supervisor restarts the whole group (``one_for_all``) from its checkpoints.
    """

    retryable = True


def token_shares(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """The indices ``0 .. len(sizes)-1`` split into ``ranks`` shares of about equal token count.

    Largest first, each sample goes to the share with the fewest tokens so far (the lowest rank
    on a tie); each share lists its indices in ascending order. A pure function of its inputs,
    so every rank computes the same partition.

    Raises:
        ValueError: ``ranks`` is below 1.
    """
    if ranks < 1:
        raise ValueError(f"token_shares: expected ranks >= 1, got {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += sizes[i]
    return [sorted(share) for share in shares]


def fingerprint(*parts: Any) -> int:
    """A 31-bit checksum of ``parts``' text: what ranks compare to know they hold the same."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _store(
    name: str,
    run_dir: str,
    generation: int,
    timeout_s: float,
    rank: int = 0,
    members: Sequence[int] = (),
    formation: int = 0,
) -> tuple[Any, str]:
    """The rendezvous store of this group and generation, and where it is (for errors).
    With the launch's store, the generation is this rank's count of earlier joins instead, under
    the group's ``members`` when it went on at a smaller size and its ``formation`` (each shrink
    or growth starts the counts afresh, so ranks whose counts diverged in an earlier formation
    meet in the next)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    address = os.environ.get(STORE_ENV, "")
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise DataParallelError(
                f"{name}: {STORE_ENV}={address!r} is not HOST:PORT; the launcher sets it to "
                f"the address of torchrun's store"
            )
        try:
            client = TCPStore(
                host, int(port), is_master=False, timeout=timeout, wait_for_workers=False
            )
        except Exception as exc:  # torch raises RuntimeError or DistNetworkError
            raise DataParallelError(
                f"{name}: cannot reach the store at {STORE_ENV}={address} within "
                f"{timeout_s:g} s ({exc}); check that the launch's node 0 is up"
            ) from exc
        base = f"{os.environ.get(PREFIX_ENV, '')}/{name}"
        if members:
            base += "/members-" + "-".join(map(str, members))
        if formation:
            base += f"/f{formation}"
        joined = int(client.add(f"{base}/joins/{rank}", 1)) - 1
        prefix = f"{base}/{joined}"
        return PrefixStore(prefix, client), f"tcp store {address} under {prefix!r}"
    folder = os.path.join(run_dir, "dist")
    os.makedirs(folder, exist_ok=True)
    # The agent's pid tells this launch from an earlier one in the same run directory
    # (``--resume``); the generation tells this attempt from the group's earlier ones.
    path = os.path.join(folder, f"{name}.{os.getppid()}.{generation}.store")
    store = FileStore(path, -1)
    store.set_timeout(timeout)
    return store, f"file store {path}"


@dataclass
class DataParallel:
    """This rank's handle on its group: the collectives a data-parallel learner or critic
    needs, each bounded by ``timeout_s``. Every method is called by every rank in the same
    order, by one thread at a time (the thread running the group's call:
    ``asyncrl.roles.training.lockstep``).

    Attributes:
        name: the learner role's name (in errors).
        rank: this replica's index in the group.
        world: the group's size.
        timeout_s: the longest any rendezvous or collective may wait.
        device: where the collectives' own tensors live (the plugin's device for its backend).
        comm: the collectives (default: the hardware plugin's, ``registry.current().comm``).
        broken: why the group broke (a collective failed); empty while it works.
    """

    name: str
    rank: int
    world: int
    timeout_s: float
    device: str = "cpu"
    comm: Communication = field(default_factory=lambda: current_plugin().comm)
    broken: str = ""
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def join(
        cls,
        *,
        name: str,
        rank: int,
        world: int,
        run_dir: str,
        generation: int,
        timeout_s: float,
        backend: str = "gloo",
        device: str = "cpu",
        comm: Communication | None = None,
        members: Sequence[int] = (),
        formation: int = 0,
    ) -> DataParallel:
        """Form the group (blocking: call it in the compute thread) and return this rank's
        handle on it. ``members``: the replicas that form the group once it went on at a
        smaller size (``RoleContext.members``), and ``formation`` (``RoleContext.formation``):
        they name the group in the store.

        Raises:
            DataParallelError: not every rank arrived within ``timeout_s`` (the message names
                the missing ones), or the store is unusable.
        """
        store, where = _store(name, run_dir, generation, timeout_s, rank, members, formation)
        store.set(f"arrived/{rank}", str(os.getpid()))
        keys = [f"arrived/{r}" for r in range(world)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # the store's timeout: a DistStoreError or RuntimeError
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise DataParallelError(
                f"{name}: data-parallel group of {world} ranks: rank(s) {missing} did not "
                f"arrive within {timeout_s:g} s ({where}, this is rank {rank}); check that "
                f"every replica of roles.{name} started (its log) and can reach the store"
            ) from exc
        if rank == 0 and not os.environ.get(STORE_ENV):
            _remove_stale(run_dir, name, where)
        dist.init_process_group(
            backend,
            store=PrefixStore("pg", store),
            rank=rank,
            world_size=world,
            # The backend's own watchdog (NCCL's aborts the process) waits twice as long as the
            # plugin's collectives, whose timeout names the missing ranks, so theirs comes first.
            timeout=datetime.timedelta(seconds=2 * timeout_s),
        )
        return cls(name, rank, world, timeout_s, device, comm or current_plugin().comm)

    def close(self) -> None:
        """Leave the group (once)."""
        if not self._closed and dist.is_initialized():
            self._closed = True
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    # -- collectives ------------------------------------------------------------------------

    def _run(self, what: str, fn: Any, *args: Any) -> Any:
        """``fn(*args, timeout_s=self.timeout_s)``, a collective of ``comm``; a failure breaks
        the group for good."""
        if self.broken:
            raise DataParallelError(
                f"{self.name}: rank {self.rank}: the data-parallel group broke earlier "
                f"({self.broken}); the group must restart"
            )
        try:
            return fn(*args, timeout_s=self.timeout_s)
        except Exception as exc:
            first = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.broken = f"rank {self.rank}: {what} failed ({first})"
            raise DataParallelError(
                f"{self.name}: {self.broken} in a group of {self.world} (the timeout is "
                f"{self.timeout_s:g} s): a rank died, or did not take part; {GROUP_HINT}"
            ) from exc

    def all_gather_ints(self, what: str, values: Sequence[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each), in rank order."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out: list[torch.Tensor] = self._run(what, self.comm.all_gather, mine)
        return [t.cpu().tolist() for t in out]

    def check_same(self, what: str, values: Sequence[int], labels: Sequence[str]) -> None:
        """Raise unless every rank holds the same ``values`` (named by ``labels``).

        Raises:
            DataParallelError: ranks differ; the message lists each rank's values.
        """
        gathered = self.all_gather_ints(what, values)
        if any(g != gathered[0] for g in gathered):
            table = "; ".join(
                f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in zip(labels, g, strict=True))
                for r, g in enumerate(gathered)
            )
            raise DataParallelError(
                f"{self.name}: the data-parallel ranks disagree on {what}: {table}; they must "
                f"hold the same state and get the same calls (restart the group to resync)"
            )

    def min_int(self, what: str, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        return min(v[0] for v in self.all_gather_ints(what, [value]))

    def broadcast_bytes(self, what: str, data: bytes = b"", src: int = 0) -> bytes:
        """``src``'s ``data`` on every rank (the others pass nothing): its size, then its
        bytes as a uint8 tensor, two broadcasts (one when it is empty)."""
        mine = self.rank == src
        size = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=self.device)
        self._run(f"{what} (its size)", self.comm.broadcast, size, src)
        n = int(size.item())
        if not n:
            return b""
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else None
        buffer = (torch.empty(n, dtype=torch.uint8) if buffer is None else buffer).to(self.device)
        self._run(what, self.comm.broadcast, buffer, src)
        return data if mine else buffer.cpu().numpy().tobytes()

    def barrier(self, what: str) -> None:
        """Return once every rank got here."""
        self._run(what, self.comm.barrier)

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks, in place, in one collective per
        dtype. A parameter keeps no gradient (None) only when it has none on any rank, as a
        single learner would leave it: the optimizer then skips it."""
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, group in by_dtype.items():
            flat = [
                torch.zeros(p.numel(), dtype=dtype, device=p.device)
                if p.grad is None
                else p.grad.reshape(-1)
                for p in group
            ]
            flags = torch.tensor(
                [p.grad is not None for p in group], dtype=dtype, device=group[0].device
            )
            buffer = torch.cat([*flat, flags])
            self._run("the gradient all-reduce", self.comm.all_reduce, buffer)
            start = 0
            for p, has in zip(group, buffer[-len(group) :].cpu().tolist(), strict=True):
                n = p.numel()
                p.grad = buffer[start : start + n].view_as(p).clone() if has else None
                start += n

    def _names(self, names: Iterable[str]) -> list[str]:
        """The union of every rank's ``names``, sorted."""
        text = "\n".join(sorted(set(names))).encode()
        sizes = self.all_gather_ints("the metric names' sizes", [len(text)])
        width = max(max(s[0] for s in sizes), 1)
        mine = torch.zeros(width, dtype=torch.uint8)
        if text:  # a rank with no rows of a step reports no metric of its own
            mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        mine = mine.to(self.device)
        out: list[torch.Tensor] = self._run("the metric names", self.comm.all_gather, mine)
        union: set[str] = set()
        for (size,), t in zip(sizes, out, strict=True):
            if size:
                union.update(bytes(t[:size].cpu().tolist()).decode().split("\n"))
        return sorted(union)

    def sum_metrics(self, steps: list[dict[str, float]]) -> list[dict[str, float]]:
        """Each optimizer step's metrics summed over the ranks (each rank's are its share of
        the weighted sums); a metric is in a step where any rank reported it. The
        ``GLOBAL_METRICS`` are taken as they are."""
        names = self._names(k for step in steps for k in step if k not in GLOBAL_METRICS)
        values = torch.zeros((len(steps), 2 * len(names)), dtype=torch.float64)
        for i, step in enumerate(steps):
            for j, name in enumerate(names):
                if name in step:
                    values[i, j] = step[name]
                    values[i, len(names) + j] = 1.0
        values = values.to(self.device)
        self._run("the metrics' all-reduce", self.comm.all_reduce, values)
        values = values.cpu()
        out = []
        for i, step in enumerate(steps):
            merged = {k: v for k, v in step.items() if k in GLOBAL_METRICS}
            for j, name in enumerate(names):
                if values[i, len(names) + j] > 0:
                    merged[name] = float(values[i, j])
            out.append(merged)
        return out

    def gather_rows(
        self,
        mine: list[list[float]],
        shares: list[list[int]],
        lengths: Sequence[int],
        what: str = "the proximal log-probs' all-gather",
    ) -> list[list[float]]:
        """Rows computed in shares, put together: ``mine`` are this rank's rows (one per index
        of ``shares[rank]``, of ``lengths[index]`` values each); returns every index's row, in
        index order, as every rank computed them. ``what`` names the gather in errors."""
        totals = [sum(lengths[i] for i in share) for share in shares]
        width = max(max(totals), 1)
        flat = torch.zeros(width, dtype=torch.float64)
        values = [v for row in mine for v in row]
        flat[: len(values)] = torch.tensor(values, dtype=torch.float64)
        flat = flat.to(self.device)
        out = self._run(what, self.comm.all_gather, flat)
        out = [t.cpu() for t in out]
        rows: list[list[float]] = [[] for _ in lengths]
        for share, t in zip(shares, out, strict=True):
            start = 0
            for i in share:
                rows[i] = t[start : start + lengths[i]].tolist()
                start += lengths[i]
        return rows


def _remove_stale(run_dir: str, name: str, current: str) -> None:
    """Store files of this group's earlier launches and attempts: every rank of those is gone
    (``one_for_all`` stops the whole group before it starts the next attempt)."""
    for path in glob.glob(os.path.join(run_dir, "dist", f"{name}.*.store")):
        if not current.endswith(path):
            with contextlib.suppress(OSError):
                os.unlink(path)


NONE_LOADABLE = -2
"""What a rank tells the others when it holds complete checkpoints but can load none of them
(``agree_checkpoint``'s ``why_none``): the group refuses to start, and removes nothing."""


def agree_checkpoint(
    dp: DataParallel,
    checkpoints: CheckpointDir,
    loadable: Sequence[int] | None = None,
    why_none: str = "",
) -> str | None:
    """The checkpoint every rank resumes from: the newest step that all of them hold (a rank
    that died mid-step may be one checkpoint behind the others); checkpoints past it are
    removed, a timeline the group goes back from. None: start from the initial weights (no
    rank holds a checkpoint). ``loadable``: the steps of this rank's complete checkpoints it
    can load (a sharded one another group wrote, whose writers' folders do not all hold it, is
    not); None: all. ``why_none``: this rank holds checkpoints but ``loadable`` is empty, and
    why (the error it raises).

    Raises:
        CheckpointError: a rank holds checkpoints but can load none (``why_none`` on that rank;
            the others name it): no checkpoint of any rank is removed, since starting from the
            initial weights would throw away the training they hold.
        DataParallelError: this rank lacks the agreed checkpoint (``keep_checkpoints`` too low,
            or checkpoints removed by hand).
    """
    steps = checkpoints.steps() if loadable is None else sorted(loadable)
    mine = steps[-1] if steps else (NONE_LOADABLE if why_none else -1)
    newest = [v[0] for v in dp.all_gather_ints("the checkpoint to resume from", [mine])]
    stuck = [r for r, v in enumerate(newest) if v == NONE_LOADABLE]
    if stuck:
        if mine == NONE_LOADABLE:
            raise CheckpointError(why_none)
        raise CheckpointError(
            f"{dp.name}: rank(s) {stuck} of the group hold checkpoints but can load none of "
            f"them (their errors say which steps and folders); this rank (rank {dp.rank}) "
            f"removed none of its own in {checkpoints.path}"
        )
    agreed = min(newest)
    if agreed < 0:
        checkpoints.drop_after(agreed)  # some rank holds none yet: all start over
        return None
    path = checkpoints.at(agreed) if agreed in steps else None
    if path is None:
        raise DataParallelError(
            f"{dp.name}: rank {dp.rank} has no checkpoint of step {agreed}, the newest every "
            f"rank holds (it has steps {steps} in {checkpoints.path}); keep at least 2 "
            f"checkpoints (keep_checkpoints) and do not remove them by hand"
        )
    checkpoints.drop_after(agreed)
    return path


def state_checksum(model: torch.nn.Module) -> int:
    """A checksum of the model's parameters' bytes: ranks compare it after a restore."""
    crc = 0
    for name, p in model.state_dict().items():
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc & 0x7FFFFFFF


def join_role(
    ctx: RoleContext, backend: str, timeout_s: float, device: torch.device
) -> DataParallel:
    """``DataParallel.join`` for a replica of a role: its name, its rank and the group's size
    (``ctx.group_rank``, ``ctx.group_size``: its replica and replicas, or its place among the
    replicas left once the group went on at a smaller size), run directory and incarnation (the
    generation). ``backend`` empty: the hardware plugin's
    (``asyncrl.plugins.registry``) when ``device`` (the model's) is the plugin's, ``gloo``
    when it is the host. Collective buffers go to ``device``."""
    plugin = current_plugin()
    return DataParallel.join(
        name=ctx.name,
        rank=ctx.group_rank,
        world=ctx.group_size,
        run_dir=ctx.run_dir,
        generation=ctx.incarnation,
        timeout_s=timeout_s,
        backend=backend or (plugin.comm.backend if device.type == plugin.device.kind else "gloo"),
        device=str(device),
        comm=plugin.comm,
        members=ctx.members,
        formation=ctx.formation,
    )


def check_restored(
    dp: DataParallel,
    model: torch.nn.Module | None,
    step: int,
    version: int,
    consumed: set[tuple[str, int]],
) -> None:
    """Raise unless every rank restored the same step, version, ledger and weights (``model``
    None: sharded ranks, each holding other shards, compare all but the weights).

    Raises:
        DataParallelError: they differ (each rank's values are listed).
    """
    values = [step, version, fingerprint(sorted(consumed))]
    labels = ["step", "version", "ledger"]
    if model is not None:
        values.append(state_checksum(model))
        labels.append("weights")
    dp.check_same("the restored state", values, labels)


def share_out(samples: Sequence[Scored], dp: DataParallel | None) -> tuple[list[list[int]], int]:
    """The samples' indices shared out to the ranks by token count (prompt and completion; one
    share of all of them without data parallelism), and this rank's index."""
    if dp is None:
        return [list(range(len(samples)))], 0
    sizes = [len(s.sample.prompt_ids) + len(s.sample.token_ids) for s in samples]
    return token_shares(sizes, dp.world), dp.rank


def rank_chunks(
    samples: Sequence[Scored],
    mask: torch.Tensor,
    dp: DataParallel | None,
    budget: int,
    aggregation: alg.Aggregation,
) -> tuple[list[list[int]], float]:
    """This rank's micro-batches of a mini-batch (indices into ``samples``, at most ``budget``
    tokens each) and the mini-batch's aggregate weight, summed over every rank's micro-batches
    (``mask`` is the mini-batch's completion mask): each micro-batch's loss is weighed by its
    own weight over that total, so the ranks' summed gradients are the mini-batch's."""
    shares, rank = share_out(samples, dp)
    by_rank = [
        [[share[i] for i in chunk] for chunk in micro_batches([samples[j] for j in share], budget)]
        for share in shares
    ]
    weights = [
        float(alg.aggregate_weight(mask[chunk], aggregation))
        for chunks in by_rank
        for chunk in chunks
        if chunk
    ]
    return [chunk for chunk in by_rank[rank] if chunk], sum(weights)
