"""The planner's setup: a training run's size, privacy target, memory budget and data pipeline."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CorrnoiseError, check_int, check_real
from .constants import PIPELINES
from .families import families

__all__ = ["PlanSetup", "make_setup"]


# ----------------------------------------------------------------------------------------------
# Setup
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSetup:
    """What the user knows about the run.  Give (dataset_size, batch_size, epochs) or
    (steps, epochs)."""

    epsilon: float
    delta: float
    epochs: int
    dataset_size: int | None = None
    batch_size: int | None = None
    steps: int | None = None
    max_buffers: int | None = None
    only: tuple[str, ...] | None = None
    pipeline: str = "auto"
    #: the model whose noise the plan is for: trainable parameter count and dtype (default
    #: float32); with them every candidate reports its noise state in bytes
    #: (:func:`corrnoise.noise_memory.noise_state_bytes`)
    trainable_params: int | None = None
    dtype: str | None = None
    #: noise-memory budget in bytes ("2GB", "512MiB", 2e9 are parsed); needs trainable_params
    max_noise_memory: int | None = None

    def __post_init__(self):
        eps = check_real("epsilon", self.epsilon, low=0.0, low_open=True)
        delta = check_real("delta", self.delta, low=0.0, high=1.0, low_open=True, high_open=True)
        epochs = check_int("epochs", self.epochs, minimum=1)
        object.__setattr__(self, "epsilon", eps)
        object.__setattr__(self, "delta", delta)
        object.__setattr__(self, "epochs", epochs)
        by_data = self.dataset_size is not None or self.batch_size is not None
        if by_data and self.steps is not None:
            raise CorrnoiseError("steps", "give either (dataset_size, batch_size, epochs) or (steps, epochs), not both")
        if by_data:
            if self.dataset_size is None or self.batch_size is None:
                missing = "dataset_size" if self.dataset_size is None else "batch_size"
                raise CorrnoiseError(missing, "is needed with (dataset_size, batch_size, epochs)")
            n_ex = check_int("dataset_size", self.dataset_size, minimum=1)
            bs = check_int("batch_size", self.batch_size, minimum=1)
            if bs > n_ex:
                raise CorrnoiseError("batch_size", f"must be <= dataset_size = {n_ex}, got {bs}")
            object.__setattr__(self, "dataset_size", n_ex)
            object.__setattr__(self, "batch_size", bs)
        elif self.steps is None:
            raise CorrnoiseError("steps", "give (dataset_size, batch_size, epochs) or (steps, epochs)")
        else:
            steps = check_int("steps", self.steps, minimum=1)
            if steps < epochs:
                raise CorrnoiseError("epochs", f"must be <= steps = {steps} (at least one step per epoch), got {epochs}")
            object.__setattr__(self, "steps", steps)
        if self.max_buffers is not None:
            object.__setattr__(self, "max_buffers", check_int("max_buffers", self.max_buffers, minimum=0))
        object.__setattr__(self, "only", _check_only(self.only))
        self._check_noise_memory()
        pipeline = str(self.pipeline).strip().lower()
        if pipeline not in PIPELINES:
            raise CorrnoiseError("pipeline", f"must be one of {', '.join(PIPELINES)}, got {self.pipeline!r}")
        object.__setattr__(self, "pipeline", pipeline)

    def _check_noise_memory(self) -> None:
        """trainable_params, dtype and max_noise_memory parsed (:mod:`corrnoise.noise_memory`)."""
        from ..noise_memory import dtype_itemsize, parse_size

        if self.trainable_params is not None:
            object.__setattr__(self, "trainable_params", check_int("trainable_params", self.trainable_params, minimum=1))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_itemsize(self.dtype)[0])
        if self.max_noise_memory is not None:
            if self.trainable_params is None:
                raise CorrnoiseError("max_noise_memory", "needs trainable_params (the model's trainable parameter "
                                     "count) to turn noise vectors into bytes")
            object.__setattr__(self, "max_noise_memory", parse_size(self.max_noise_memory))

    # --- derived ------------------------------------------------------------------------------
    @property
    def noise_dtype(self) -> str:
        """The dtype the noise state is counted in (float32 unless given)."""
        return self.dtype or "float32"

    @property
    def steps_per_epoch(self) -> int:
        """b: fixed-size batches per epoch (N // B), or ceil(n / K) given the steps."""
        if self.steps is None:
            return self.dataset_size // self.batch_size
        return -(-self.steps // self.epochs)

    @property
    def n(self) -> int:
        """The number of steps."""
        return self.epochs * self.steps_per_epoch if self.steps is None else self.steps

    @property
    def participations(self) -> int:
        """k: how often an example takes part in cyclic order, ceil(n / b)."""
        return -(-self.n // self.steps_per_epoch)

    @property
    def sampling_probability(self) -> float:
        """p = B / N (or 1 / b given the steps): one example's rate per step."""
        if self.steps is None:
            return self.batch_size / self.dataset_size
        return 1.0 / self.steps_per_epoch

    @property
    def participation(self) -> str:
        return f"cyclic:{self.participations}:{self.steps_per_epoch}"

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.only is not None:
            out["only"] = list(self.only)
        out.update(n=self.n, steps_per_epoch=self.steps_per_epoch, participations=self.participations,
                   sampling_probability=self.sampling_probability, participation=self.participation)
        return out


def _check_only(only) -> tuple[str, ...] | None:
    if only is None:
        return None
    if isinstance(only, str):
        only = [s for s in only.split(",")]
    names = tuple(str(s).strip().lower() for s in only if str(s).strip())
    if not names:
        raise CorrnoiseError("only", f"names no family; choose from {', '.join(families())}")
    for name in names:
        if name not in families():
            raise CorrnoiseError("only", f"unknown family {name!r}; choose from {', '.join(families())}")
    return names


def make_setup(setup: PlanSetup | dict | None = None, **kwargs: Any) -> PlanSetup:
    """A :class:`PlanSetup` from one, from a dict, or from keyword arguments."""
    if isinstance(setup, PlanSetup):
        if kwargs:
            from dataclasses import replace

            return replace(setup, **kwargs)
        return setup
    if setup is None:
        setup = {}
    if not isinstance(setup, dict):
        raise CorrnoiseError("setup", f"expected a PlanSetup or a dict, got {type(setup).__name__}")
    args = {**setup, **kwargs}
    for key in ("epsilon", "delta", "epochs"):
        if key not in args:
            raise CorrnoiseError(key, "is required")
    known = set(PlanSetup.__dataclass_fields__)
    for key in args:
        if key not in known:
            raise CorrnoiseError(key, f"is not a planner setting (known: {', '.join(sorted(known))})")
    return PlanSetup(**args)


# ----------------------------------------------------------------------------------------------
# Candidates and results
