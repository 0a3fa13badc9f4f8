"""Distributed correlated noise: every rank generates its shard of every noise row.

Tutorial Sec. 4.4.5, "sharding noise across all machines": the m coordinates are split as
evenly as possible into M groups G_0..G_{M-1} (contiguous ranges, the first m mod M ranks one
coordinate longer), and rank i computes only

    ( (C^{-1} Z)[t, j] : j in G_i )                                              (Eq. 4.13)

with its own streaming generator (banded buffers, BLT buffers, regenerated seed noise: all of
it only for its coordinates), so the work and the memory per machine are 1/M of the total and
no communication is needed to compute it. The seed noise Z is counter-based
(:mod:`corrnoise.noise.seeds`): coordinate j of row t is the same number whichever rank draws
it, so the assembled row equals the single-process row for the same seed exactly. The row is
then assembled with one ``all_gather`` so it can be added to the (all-reduced) gradient.

All ranks must use the same seed; with ``seed=None`` rank 0 draws a 256-bit secret one and
broadcasts all of its bits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import CorrnoiseError, check_int
from ..noise import DEFAULT_CHUNK, make_generator, resolve_dim
from ..noise.seeds import check_seed, new_secret_seed
from ..noise.base import split_flat
from .privatizer import Privatizer, noise_dtype

__all__ = ["shard_bounds", "ShardedNoise", "DistributedPrivatizer", "broadcast_seed", "local_batch",
           "seed_to_limbs", "limbs_to_seed", "data_parallel", "refuse_sharded_parameters", "global_rank0", "shared_sampler_seed", "broadcast_module"]


def shard_bounds(m: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's group G_rank: m split as evenly as possible (Sec. 4.4.5)."""
    m = check_int("dim", m, minimum=1)
    world_size = check_int("world_size", world_size, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=world_size - 1)
    base, extra = divmod(m, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise CorrnoiseError("distributed", "torch.distributed is not initialized (call init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def seed_to_limbs(seed: int) -> list[int]:
    """A non-negative seed as little-endian 32-bit limbs (at least one), exact for any size."""
    seed = check_seed(seed)
    limbs = []
    while True:
        limbs.append(seed & 0xFFFFFFFF)
        seed >>= 32
        if not seed:
            return limbs


def limbs_to_seed(limbs) -> int:
    """Inverse of :func:`seed_to_limbs`."""
    return sum(int(v) << (32 * i) for i, v in enumerate(limbs))


def broadcast_seed(seed: int | None, group=None) -> int:
    """The same seed on every rank: ``seed`` if given (checked equal), else rank 0's secret one.

    Every bit is broadcast (the default secret has 256 bits): first the number of 32-bit
    limbs, then the limbs, each in an int64 slot. A mismatch message never prints the seeds.
    """
    rank, _ = _world(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if seed is not None:
        seed = check_seed(seed)
    mine = seed if seed is not None else (new_secret_seed() if rank == 0 else None)
    header = torch.tensor([len(seed_to_limbs(mine)) if mine is not None else 0], dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    payload = torch.zeros(int(header[0]), dtype=torch.int64)
    if rank == 0:
        payload.copy_(torch.tensor(seed_to_limbs(mine), dtype=torch.int64))
    dist.broadcast(payload, src=src, group=group)
    value = limbs_to_seed(payload.tolist())
    if seed is not None and value != seed:
        raise CorrnoiseError("seed", "ranks disagree on the noise seed (pass the same noise seed on every rank)")
    return value


class ShardedNoise:
    """nu * (C^{-1} Z)[t] generated in shards across the ranks of a process group.

    ``next_shard()`` returns this rank's coordinates only (no communication); ``next()`` /
    ``next_flat()`` also assemble the full row on every rank with ``all_gather``. Behaves like a
    :class:`corrnoise.noise.NoiseGenerator` for a :class:`~corrnoise.torch.Privatizer`.
    """

    def __init__(self, strategy, dim: Any, *, noise_std: float = 1.0, seed: int | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, method: str = "auto",
                 chunk_size: int = DEFAULT_CHUNK, group=None):
        self.group = group
        self.rank, self.world_size = _world(group)
        self.m, self.shapes = resolve_dim(dim)
        if self.m < self.world_size:
            raise CorrnoiseError("dim", f"{self.m} coordinates cannot be split over {self.world_size} ranks")
        self.seed = broadcast_seed(seed, group)
        self.start, self.stop = shard_bounds(self.m, self.world_size, self.rank)
        self.bounds = [shard_bounds(self.m, self.world_size, r) for r in range(self.world_size)]
        self.local = make_generator(strategy, self.m, noise_std=noise_std, seed=self.seed, device=device, dtype=dtype,
                                    method=method, shard=(self.start, self.stop), chunk_size=chunk_size)
        self._width = max(b - a for a, b in self.bounds)

    # generator look-alike -------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.local.n

    @property
    def t(self) -> int:
        return self.local.t

    @property
    def noise_std(self) -> float:
        return self.local.noise_std

    def next_shard(self) -> torch.Tensor:
        """This rank's coordinates [start, stop) of the current row (Eq. 4.13), then advance."""
        return self.local.next_flat()

    def next_flat(self) -> torch.Tensor:
        """The full current row, assembled from every rank's shard (one all_gather)."""
        shard = self.next_shard()
        padded = torch.zeros(self._width, dtype=shard.dtype, device=shard.device)
        padded[: shard.numel()] = shard
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[: b - a] for p, (a, b) in zip(parts, self.bounds)])

    def next(self):
        flat = self.next_flat()
        return flat if self.shapes is None else split_flat(flat, self.shapes)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard state (save one per rank). The secret seed sits at the top level
        (``state["seed"]``), as in a generator's state, so that a checkpoint writer that drops
        ``"seed"`` (``DPOptimizer`` without ``store_noise_seed``) drops it here too."""
        local = dict(self.local.state_dict())
        seed = local.pop("seed")
        return {"rank": self.rank, "world_size": self.world_size, "seed": seed, "local": local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rank") != self.rank or state.get("world_size") != self.world_size:
            raise CorrnoiseError("state", f"saved by rank {state.get('rank')} of {state.get('world_size')}, "
                                 f"this is rank {self.rank} of {self.world_size}")
        local = dict(state["local"])
        if "seed" in state:
            local["seed"] = state["seed"]
        elif "seed" not in local:
            local["seed"] = self.seed
        self.local.load_state_dict(local)
        self.seed = self.local.seed


def local_batch(indices, rank: int, world_size: int) -> list:
    """This rank's part of a global batch: every ``world_size``-th index from ``rank``.

    All ranks iterate the same sampler (same seed), so the global batch -- the one the
    accounting analyses -- is formed once, and the ranks' parts partition it."""
    rank = check_int("rank", rank, minimum=0, maximum=check_int("world_size", world_size, minimum=1) - 1)
    return list(indices)[rank::world_size]


class DistributedPrivatizer(Privatizer):
    """Data-parallel privatizer: every rank clips and sums the gradients of *its* examples;
    ``privatize`` all-reduces the sums (so the sum is over the global batch, sensitivity still
    one clip norm), adds the sharded-then-gathered noise once and divides by the global expected
    batch size. Every rank ends with the same g_hat_t."""

    def __init__(self, generator: ShardedNoise, clip_norm: float, expected_batch_size: float):
        super().__init__(generator, clip_norm, expected_batch_size)
        self.group = generator.group

    @classmethod
    def for_parameters(cls, strategy, parameters, *, noise_std, clip_norm, expected_batch_size, seed=None,
                       method="auto", group=None, chunk_size: int = DEFAULT_CHUNK) -> "DistributedPrivatizer":
        parameters = list(parameters)
        if not parameters:
            raise CorrnoiseError("parameters", "no parameters to privatize")
        gen = ShardedNoise(strategy, [p.shape for p in parameters], noise_std=noise_std, seed=seed,
                           device=parameters[0].device, dtype=noise_dtype(parameters), method=method,
                           chunk_size=chunk_size, group=group)
        return cls(gen, clip_norm, expected_batch_size)

    def all_reduce(self, sums) -> list[torch.Tensor]:
        """The sums over every rank (SUM), one coalesced all_reduce per (dtype, device)."""
        sums = list(sums)
        total: list[torch.Tensor | None] = [None] * len(sums)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(sums):
            groups.setdefault((s.dtype, s.device), []).append(i)
        for idx in groups.values():
            flat = torch.cat([sums[i].reshape(-1) for i in idx])  # a copy: the inputs are untouched
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            for i, part in zip(idx, flat.split([sums[i].numel() for i in idx])):
                total[i] = part.view(sums[i].shape)
        return total

    def all_reduce_counts(self, *counts: int) -> tuple[int, ...]:
        """Integers summed over the ranks (batch statistics of the global batch)."""
        t = torch.tensor([float(c) for c in counts], dtype=torch.float64)
        if dist.get_backend(self.group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return tuple(int(round(v)) for v in t.tolist())

    def privatize(self, sums):
        """All-reduce the clipped sums first, then add the one noise row (identical on every
        rank, generated in shards and gathered) and divide by the global expected batch size."""
        return super().privatize(self.all_reduce(sums))


# ----------------------------------------------------------------------------------------------
# Data parallel (torch.distributed)
# ----------------------------------------------------------------------------------------------
def refuse_sharded_parameters(module: torch.nn.Module) -> None:
    """One line naming ``module`` when its parameters are sharded (FSDP's ``fully_shard``:
    DTensor parameters). Measured (torch 2.13, CPU, gloo, 2 ranks): ``fully_shard`` itself works,
    but per-example clipping needs each layer's full weight on every rank and the clipped sum
    reduce-scattered back to the shards, which the engine does not do."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor has no fully_shard either
        return
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise CorrnoiseError("module", "has sharded (FSDP fully_shard / DTensor) parameters, which the clipping "
                             "engine does not support yet; use DistributedDataParallel (the noise is sharded "
                             "across ranks anyway) or train LoRA adapters")


def data_parallel(module: torch.nn.Module, distributed: bool | None):
    """(on, process group, module to hook) for ``distributed`` (see :func:`make_private`)."""
    from torch.nn.parallel import DistributedDataParallel

    refuse_sharded_parameters(module)
    is_ddp = isinstance(module, DistributedDataParallel)
    initialized = dist.is_available() and dist.is_initialized()
    if distributed is None:
        distributed = is_ddp or initialized
    if not distributed:
        if is_ddp:
            raise CorrnoiseError("distributed", "is False but the module is DistributedDataParallel: DDP averages "
                                 "the ranks' gradients, so each rank's sampler, noise and accounting would not be "
                                 "what is released; pass the inner module (module.module) instead")
        return False, None, module
    if not initialized:
        raise CorrnoiseError("distributed", "torch.distributed is not initialized (call init_process_group first)")
    if not is_ddp:
        return True, None, module
    if getattr(module, "_delay_all_reduce_all_params", False) or getattr(module, "_delay_all_reduce_params", None):
        raise CorrnoiseError("module", "DistributedDataParallel with delayed all-reduce parameters all-reduces "
                             "unclipped gradients even under no_sync(); build DDP without them")
    # every step overwrites .grad with the privatized sum: DDP's all-reduce of unclipped gradients
    # is wasted work, and ranks with different numbers of micro-batches would issue different
    # numbers of collectives. no_sync() does exactly this, for good here.
    module.require_backward_grad_sync = False
    return True, getattr(module, "process_group", None), module.module


def global_rank0(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def shared_sampler_seed(seed: int | None, group) -> int:
    """The sampler seed of rank 0 on every rank (``seed`` checked equal where given, else drawn
    on rank 0): one global sampler, so every rank forms the same, accounted, batches."""
    from ..sampling import SEED_MAX

    value = broadcast_seed(seed, group)
    return value if seed is not None else value & SEED_MAX


def check_same_run(fields: dict[str, Any], group) -> None:
    """Refuse, on every rank, a data-parallel run whose ranks do not agree on what the guarantee
    is of (``fields``: the plan's mechanism fingerprint, batching, lengths and noise, the clip norm,
    the loss reduction, the noise method, the noised coordinates). Each rank clips with its own
    ``max_grad_norm`` and cuts its own share of the sampler's batch, and one noise row is
    assembled from every rank's shard, so a rank with another clip norm (found in review: rank 1
    at 10 where rank 0 accounted 1, a released sum of 10.9 from 8 examples), another mechanism or
    another batch size would release what no guarantee covers. One line naming the first field
    that differs, with its value on rank 0 and on the first rank that differs."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fields, group=group)
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        for key in reference:
            if other.get(key) != reference[key]:
                raise CorrnoiseError(key, f"differs between the data-parallel ranks (rank 0: {reference[key]!r}, "
                                     f"rank {rank}: {other.get(key)!r}); every rank must make the same make_private "
                                     "call (the same plan, max_grad_norm and model, a ready sampler built with the "
                                     "same seed)")


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, group) -> None:
    """Rank 0's parameters and buffers on every rank."""
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=global_rank0(group), group=group)
