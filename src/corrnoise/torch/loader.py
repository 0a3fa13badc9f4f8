"""The private data loader: the batches a corrnoise sampler draws, as the user's DataLoader would.

:class:`DPDataLoader` yields the batches of a sampler (Poisson, block-cyclic Poisson,
balls-in-bins, cyclic) from the user's dataset, collate function and workers, so the batches are
the ones the accounting analyses. With ``max_physical_batch_size`` it cuts each sampled (logical)
batch into micro-batches and tells the optimizer where a logical batch ends (one noise row per
logical step). Padding entries of fixed-size balls-in-bins batches (seed 000 App. I) are real
items whose contribution the optimizer masks to zero. In data-parallel runs every rank draws the
same global batch and yields its own share (:func:`.distributed.local_batch`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader

from ..errors import CorrnoiseError, check_int
from ..pipelines import BATCHINGS
from ..runplan import choose_batching
from ..sampling import BallsInBinsSampler, BatchSampler

__all__ = ["DPDataLoader", "BATCHINGS", "StepContext", "choose_batching", "loader_settings"]


class StepContext:
    """What the loader and the optimizer share: the next step to take (the optimizer's
    ``steps_taken``), the logical step of the micro-batch the user's loop is on and its position
    in it, whether more micro-batches of it follow, its size (None once the optimizer took it)
    and which entries are padding."""

    def __init__(self) -> None:
        self.next_step = 0
        self.current_step: int | None = None
        self.micro_batch = 0  # the position of that micro-batch in its logical batch
        #: whether a forward with gradients is captured and waits for optimizer.step() (DPOptimizer
        #: sets it: its engine's); None without an optimizer
        self.captured: Callable[[], bool] | None = None
        self.more_micro_batches = False
        self.size: int | None = None
        self.mask: torch.Tensor | None = None

    def clear_batch(self) -> None:
        self.more_micro_batches = False
        self.size = None
        self.mask = None


def _pass_seed(sampler_seed: int, step: int) -> int:
    """The seed of the generator a pass of the private loader draws its workers' base seed from:
    BLAKE2b of the sampler's seed and the pass's first step (the sampler's seed stays unreadable
    from it), 63 bits."""
    import hashlib

    data = f"{int(sampler_seed)}:{int(step)}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"corrnoise-pass").digest(), "little") >> 1


class _Collate:
    """The user's collate function, except that an empty batch (Poisson sampling) becomes the
    collation of one item cut to length 0 (every tensor gets a leading dimension 0)."""

    def __init__(self, dataset, collate_fn):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.template = None

    def __call__(self, items):
        if len(items):
            return self.collate_fn(items)
        if self.template is None:
            self.template = self.collate_fn([self.dataset[0]])
        return _empty_like(self.template)


def _empty_like(value):
    """``value`` (a collated batch) with every tensor cut to 0 rows, as a new container each call:
    a mapping that is not a dict (transformers' ``BatchEncoding``, what its collators return) was
    returned as it was, one row of the dataset's first item, the same object for every empty batch
    (found in review: a step with two empty micro-batches stopped the Trainer)."""
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, (list, tuple)):
        return type(value)(_empty_like(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, MutableMapping):  # its own type (BatchEncoding, OrderedDict), a fresh copy
        out = copy.copy(value)
        for k in list(value.keys()):
            out[k] = _empty_like(value[k])
        return out
    if isinstance(value, Mapping):
        return {k: _empty_like(v) for k, v in value.items()}
    return value


class _PaddedItems:
    """Dataset view in which index N + j is item j again (a padding entry of a fixed-size
    balls-in-bins batch, seed 000 App. I); the optimizer gives it weight 0."""

    def __init__(self, dataset, num_examples: int):
        self.dataset, self.num_examples = dataset, num_examples

    def __len__(self) -> int:
        return 2 * self.num_examples

    def __getitem__(self, index):
        index = int(index)
        return self.dataset[index - self.num_examples if index >= self.num_examples else index]


class _MicroBatches:
    """Batch sampler over steps [start, stop) of a corrnoise sampler, each logical batch cut
    into micro-batches of at most ``size`` entries (an empty batch stays one empty micro-batch),
    or into exactly ``parts`` near-equal micro-batches (some may be empty).
    With ``world_size > 1`` only this rank's share of each logical batch (:func:`.distributed.local_batch`)."""

    def __init__(self, sampler: BatchSampler, size: int | None, rank: int = 0, world_size: int = 1,
                 parts: int | None = None):
        self.sampler, self.size, self.parts = sampler, size, parts
        self.rank, self.world_size = rank, world_size
        self.start, self.stop = 0, sampler.steps

    def cuts(self) -> Iterator[tuple[int, list[int], bool]]:
        """(step, indices, last micro-batch of the step) in order."""
        from .distributed import local_batch

        for t in range(self.start, self.stop):
            batch = list(self.sampler.batch(t))
            if self.world_size > 1:
                batch = local_batch(batch, self.rank, self.world_size)
            if self.parts is not None:
                yield from _equal_parts(t, batch, self.parts)
                continue
            if self.size is None or len(batch) <= self.size:
                yield t, batch, True
                continue
            for lo in range(0, len(batch), self.size):
                yield t, batch[lo: lo + self.size], lo + self.size >= len(batch)

    def __len__(self) -> int:
        return sum(1 for _ in self.cuts())

    def __iter__(self):
        for _, batch, _ in self.cuts():
            yield batch


def _equal_parts(t: int, batch: list[int], parts: int) -> Iterator[tuple[int, list[int], bool]]:
    """Batch ``t`` cut into exactly ``parts`` contiguous micro-batches whose sizes differ by at
    most one (the first ``len(batch) % parts`` one larger; empty ones when the batch is short)."""
    base, extra = divmod(len(batch), parts)
    lo = 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        yield t, batch[lo:hi], i == parts - 1
        lo = hi


class DPDataLoader(DataLoader):
    """A DataLoader over the batches of a corrnoise sampler (see the module docstring).

    One pass (``for batch in loader``) yields the next epoch of steps (``steps_per_epoch``
    logical batches, fewer at the end of the run), starting at the optimizer's next step, so
    ``for epoch in range(epochs): for batch in loader:`` takes exactly the planned steps and a
    resumed run continues where its checkpoint stopped. Iterating keeps the optimizer informed
    (micro-batch ends, padding masks); it yields exactly what the user's collate function makes
    of the items, nothing added.

    Data parallel (``world_size > 1``): every rank holds the same sampler (same seed), so every
    rank forms the same global -- accounted -- batch and yields only its ``rank``-th share
    (every ``world_size``-th index); the shares partition the batch. A share may be empty.

    ``micro_batches=k`` (instead of ``max_physical_batch_size``) cuts every logical batch into
    exactly k near-equal micro-batches, some possibly empty: for loops that accumulate a fixed
    number of backward passes per optimizer step (the Hugging Face Trainer's
    ``gradient_accumulation_steps``), so that their optimizer steps and the logical batches
    line up whatever size the sampler drew.
    """

    def __init__(self, dataset, sampler: BatchSampler, *, steps_per_epoch: int, collate_fn=None,
                 max_physical_batch_size=None, context: StepContext | None = None, rank: int = 0,
                 world_size: int = 1, micro_batches: int | None = None, **loader_kwargs):
        from torch.utils.data import default_collate

        self.corrnoise_sampler = sampler
        self.steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        self.context = context or StepContext()
        self.max_physical_batch_size = max_physical_batch_size
        self._padded = isinstance(sampler, BallsInBinsSampler) and sampler.batch_size is not None
        items = _PaddedItems(dataset, sampler.num_examples) if self._padded else dataset
        self.world_size = check_int("world_size", world_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        if micro_batches is not None:
            micro_batches = check_int("micro_batches", micro_batches, minimum=1)
            if max_physical_batch_size is not None:
                raise CorrnoiseError("micro_batches", "give it or max_physical_batch_size, not both")
        self.micro_batches = micro_batches
        self._cutter = _MicroBatches(sampler, max_physical_batch_size, self.rank, self.world_size, micro_batches)
        super().__init__(items, batch_sampler=self._cutter,
                         collate_fn=_Collate(dataset, collate_fn or default_collate), **loader_kwargs)

    #: whether a subclass hands each micro-batch's context to the optimizer itself (the Trainer's
    #: loader fetches a step's micro-batches before training on them)
    _prefetched = False

    def _window(self) -> None:
        start = self.context.next_step
        self._cutter.start = start
        self._cutter.stop = min(start + self.steps_per_epoch, self.corrnoise_sampler.steps)

    def __len__(self) -> int:
        self._window()
        return len(self._cutter)

    def _base_iterator(self):
        """DataLoader's iterator over this pass's batches, made without a draw from torch's global
        generator. DataLoader draws its workers' base seed there unless it has its own
        ``generator``, so a pass started mid-run (a resumed run's first) would shift every later
        draw -- dropout masks -- against the uninterrupted run. Found by a probe: a GPT-2 with
        dropout resumed from a checkpoint ended 1.5e-3 away from the same run uninterrupted, where
        the Trainer restored the checkpoint's generator state before this pass started.

        Without the user's ``generator`` the base seed comes from one made for the pass
        (:func:`_pass_seed`): the same on a resumed pass, another on every pass (found in review:
        restoring the global state instead gave workers the same seed on every pass of a run that
        draws nothing else there, so each epoch repeated the last one's augmentations)."""
        if self.generator is not None:
            return super().__iter__()
        self.generator = torch.Generator().manual_seed(
            _pass_seed(getattr(self.corrnoise_sampler, "seed", 0), self.context.next_step))
        try:
            return super().__iter__()
        finally:
            self.generator = None

    def __iter__(self):
        if self.context.next_step >= self.corrnoise_sampler.steps:
            # a loop longer than the plan would otherwise run on without data and say nothing
            raise CorrnoiseError("epochs", f"all {self.corrnoise_sampler.steps} planned steps are taken: the private "
                                 "loader has no more batches (the guarantee covers no more); loop for the epochs given "
                                 "to make_private, or plan more")
        self._window()
        num = self.corrnoise_sampler.num_examples
        cuts = self._cutter.cuts()
        position, yielded = 0, False
        for (t, indices, last), batch in zip(cuts, self._base_iterator()):
            captured = self.context.captured
            if (yielded and captured is not None and not self._prefetched and self.context.size is not None
                    and captured()):
                # found in review: two micro-batches forwarded before one backward were clipped as
                # one example each pair (a released sum that moved by 2 C for one example)
                raise CorrnoiseError("optimizer", f"the private loader's next batch was asked for before "
                                     f"optimizer.step() took the previous one (step {self.context.current_step}): "
                                     "call loss.backward() and optimizer.step() on each batch it yields (with "
                                     "max_physical_batch_size, step() after each micro-batch keeps its clipped sum "
                                     "and adds the noise after the last); losses of several batches summed before "
                                     "one backward would be clipped together")
            if self.context.current_step != t:
                self.context.clear_batch()
                self.context.current_step = t
                position = 0
            self.context.micro_batch = position
            position += 1
            yielded = True
            self.context.size = len(indices)
            self.context.mask = torch.tensor([0.0 if i >= num else 1.0 for i in indices]) if self._padded else None
            self.context.more_micro_batches = not last
            yield batch


def loader_settings(data_loader) -> tuple[Any, int, dict[str, Any], Any]:
    """(dataset, batch size, DataLoader keyword arguments to keep, collate_fn) of the user's loader."""
    if not isinstance(data_loader, DataLoader):
        raise CorrnoiseError("data_loader", f"must be a torch DataLoader, got {type(data_loader).__name__}")
    dataset = data_loader.dataset
    from ..sampling import PaddedDataset

    if isinstance(dataset, PaddedDataset):  # found in review: planned for 2N examples, each one twice
        raise CorrnoiseError("data_loader", "its dataset is BallsInBinsSampler.wrap_dataset's padded one (2N items, "
                             "each example twice): give the plain dataset; the private loader pads fixed-size "
                             "balls-in-bins batches itself and masks the padding")
    try:
        len(dataset)
    except TypeError:
        raise CorrnoiseError("data_loader", "needs a map-style dataset with a length (sampling needs indices)") from None
    batch_size = data_loader.batch_size
    if batch_size is None:
        sampler = data_loader.batch_sampler
        batch_size = getattr(sampler, "batch_size", None)
    if batch_size is None:
        raise CorrnoiseError("data_loader", "has no batch_size to take as the expected batch size; build it with "
                             "DataLoader(dataset, batch_size=B)")
    keep = {k: getattr(data_loader, k) for k in ("num_workers", "pin_memory", "timeout", "worker_init_fn",
                                                  "multiprocessing_context", "generator", "persistent_workers")}
    keep = {k: v for k, v in keep.items() if v is not None}
    if not keep.get("num_workers"):
        keep.pop("persistent_workers", None)
    if keep.get("num_workers") and getattr(data_loader, "prefetch_factor", None) is not None:
        keep["prefetch_factor"] = data_loader.prefetch_factor
    return dataset, int(batch_size), keep, data_loader.collate_fn

