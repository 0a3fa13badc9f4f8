"""The run as one value: :class:`RunPlan`, and its file (review a plan before spending any privacy).

A plan file is a small JSON document (``corrnoise.runplan``, version 1) beside the mechanism
file of its C (:func:`corrnoise.strategies.save_mechanism`: ``<stem>.mechanism.json`` and, for
large arrays, ``<stem>.mechanism.npz``). Loading re-checks everything the plan claims, by
content: the mechanism's fingerprint equals the recorded one, the sampler it names is the one it
describes, the batching is the sampler's, the accounting gate passes, and the guarantee is of
exactly this run (:func:`corrnoise.accounting.run_identity`) with this noise_std and delta.
The guarantee's epsilon is a claim until this code proves it again
(:func:`~corrnoise.runplan.agreement.reproved_guarantee`): analytic
accounting is re-run at the plan's noise; a Monte Carlo guarantee is read from the cache of
verified guarantees or verified afresh (seed 000 Thm 2.1; ~1e8 samples at delta 1e-5).
Any disagreement is a one-line CorrnoiseError naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from ..accounting import (
    RUN_IDENTITY_KEYS,
    BallsInBins,
    MechanismEvent,
    NoBatching,
    PrivacyResult,
    column_norm,
    parse_batching,
    prepare,
    run_identity,
    run_mismatch,
)
from ..errors import CorrnoiseError, check_int, check_real
from ..sampling import make_sampler
from ..strategies import Strategy, load_mechanism, mechanism_fingerprint, parse_strategy, save_mechanism
from ..strategies.io import read_json_document
from .agreement import Agreement, refuse_non_guarantees, reproved_guarantee
from .batching import SamplerSpec

__all__ = ["RunPlan", "FORMAT", "VERSION", "check_plan_path"]

FORMAT = "corrnoise.runplan"
VERSION = 1
#: the plan's field that a mismatching :func:`~corrnoise.accounting.run_identity` key names
_FIELD_OF_IDENTITY = {"fingerprint": "mechanism", "n": "steps", "batching": "batching", "participation": "participation"}


@dataclass(frozen=True, eq=False)
class RunPlan:
    """A planned private run, decided once (:func:`corrnoise.runplan.plan_run`) and torch-free.

    ``strategy``: the mechanism C; ``sampler``: how batches are formed, without the secret seed
    (:class:`~corrnoise.runplan.SamplerSpec`); ``event``: the
    :class:`~corrnoise.accounting.MechanismEvent` that runs (C, batching, steps, noise_std);
    ``method``: the accounting method the gate chose for it; ``guarantee``: the formal
    (epsilon, delta) guarantee the noise was calibrated to (or the given one it matches; None
    when the noise was given as noise_std or noise_multiplier); ``dataset_size``,
    ``batch_size``, ``epochs`` (the length as given, None when given in steps),
    ``steps_per_epoch`` (a pass of the private loader), ``delta``; the accounting method and
    options ``privacy_spent`` uses; ``label`` (the mechanism as named, for people);
    ``pipeline`` (the data pipeline planned for) and the planner's ``candidates``.
    ``planner_result`` (the planner's full result, for its plot) is not saved.
    ``noise_method``: how the noise generator runs (``"regenerate"`` where the planner's noise
    memory budget did not fit the buffers; :func:`corrnoise.noise.make_generator`).
    """

    strategy: Strategy
    sampler: SamplerSpec
    event: MechanismEvent
    method: str
    guarantee: PrivacyResult | None
    dataset_size: int
    batch_size: int
    epochs: float | None
    steps_per_epoch: int
    delta: float
    accounting_method: str = "auto"
    accounting_options: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    pipeline: str | None = None
    candidates: tuple = ()
    planner_result: Any = field(default=None, repr=False)
    noise_method: str = "auto"

    # --- what the run is ------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self.event.steps

    @property
    def batching(self):
        """The accounting's :class:`~corrnoise.accounting.Batching` of the run."""
        return self.event.batching

    @property
    def noise_std(self) -> float:
        return self.event.noise_std

    @cached_property
    def noise_multiplier(self) -> float:
        """sigma = noise_std / ||C||_col (what the optimizer reports)."""
        return self.noise_std / column_norm(self.strategy)

    @cached_property
    def fingerprint(self) -> str:
        """The mechanism's identity by content (:func:`~corrnoise.strategies.mechanism_fingerprint`)."""
        return mechanism_fingerprint(self.strategy)

    @property
    def agreement(self) -> Agreement:
        """What the gate established (the event without its noise)."""
        return Agreement(steps=self.steps, batching=self.batching, method=self.method,
                         event=self.event.without_noise())

    def with_noise(self, noise_std: float, guarantee: PrivacyResult | None) -> "RunPlan":
        """The same run with another noise (data parallel: the noise rank 0 calibrated)."""
        return replace(self, event=self.event.with_noise(noise_std), guarantee=guarantee)

    def check_guarantee(self) -> None:
        """Refuse (one line) a guarantee that is not of exactly this run, noise and delta, or that
        this code cannot prove again (:func:`~corrnoise.runplan.agreement.reproved_guarantee`): a
        plan can be rebuilt with :meth:`with_noise` or ``dataclasses.replace`` (found in review: a
        plan with a third of its noise kept its guarantee, and epsilon 2 was reported for a run of
        epsilon 7.08)."""
        if self.guarantee is not None:
            reproved_guarantee(_checked_guarantee(self.guarantee.to_dict(), self.event, self.delta), self.event,
                               self.method, self.accounting_options, "the plan's guarantee")

    def check_parts(self, sampler) -> None:
        """Refuse (one line naming ``plan``) a plan whose parts are not of one run: the noise comes
        from ``strategy``, the batches from ``sampler`` (this plan's, built), the accounting from
        ``event`` (found in review: ``dataclasses.replace(plan, strategy=Identity(n))`` trained
        identity noise under bsr:3's guarantee, and another sampler sampled at p = 0.5 where 0.1
        was accounted: epsilon 9.6 reported as 2)."""
        from .agreement import check_agreement

        if mechanism_fingerprint(self.strategy) != mechanism_fingerprint(self.event.strategy):
            raise CorrnoiseError("plan", f"its mechanism {self.strategy.label} is not the one its accounting is of "
                                 f"({self.event.strategy.label}, by fingerprint): plan again")
        formed = check_agreement(self.strategy, sampler=sampler, steps=self.event.steps, method=self.method,
                                 delta=self.delta).event.batching
        if formed != self.event.batching:
            raise CorrnoiseError("plan", f"its sampler forms {formed.spec} but its accounting is of "
                                 f"{self.event.batching.spec}: plan again")

    def check_fits(self, *, dataset_size: int | None = None, batch_size: int | None = None,
                   steps: int | None = None, epochs: float | None = None) -> None:
        """Refuse (one line naming the field) a data loader or length other than the plan's."""
        said = {"dataset_size": "examples", "batch_size": "as the (expected) batch size", "steps": "steps",
                "epochs": "epochs"}
        for name, given in (("dataset_size", dataset_size), ("batch_size", batch_size), ("steps", steps),
                            ("epochs", epochs)):
            mine = getattr(self, name)
            if given is not None and given != mine:
                raise CorrnoiseError(name, f"the plan is for {mine!r} {said[name]}, this run has {given!r}; use the "
                                     "data and length the plan was made for, or plan again")

    # --- the file ---------------------------------------------------------------------------------
    def to_dict(self, mechanism_file: str | None = None) -> dict[str, Any]:
        """The plan as JSON-able data (the mechanism by its file name and fingerprint)."""
        batching = self.batching
        return {
            "format": FORMAT, "version": VERSION,
            "mechanism": {"file": mechanism_file, "label": self.strategy.label}, "label": self.label,
            "fingerprint": self.fingerprint, "dataset_size": self.dataset_size, "batch_size": self.batch_size,
            "steps": self.steps, "epochs": self.epochs, "steps_per_epoch": self.steps_per_epoch,
            "batching": batching.spec,
            "participation": batching.participation.spec if isinstance(batching, NoBatching) else None,
            "sampler": self.sampler.to_dict(), "pipeline": self.pipeline, "delta": self.delta,
            "noise_std": self.noise_std, "noise_multiplier": self.noise_multiplier, "method": self.method,
            "accounting_method": self.accounting_method, "accounting_options": dict(self.accounting_options),
            "guarantee": None if self.guarantee is None else self.guarantee.to_dict(),
            "candidates": list(self.candidates), "noise_method": self.noise_method,
        }

    def to_json(self, path: str | Path) -> Path:
        """Write the plan to ``path`` (.json) and its mechanism beside it (``<stem>.mechanism.json``
        and, for large arrays, ``.npz``: the mechanism-file format)."""
        path = check_plan_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        mechanism_path = path.with_name(path.stem + ".mechanism.json")
        save_mechanism(self.strategy, mechanism_path, designed_for={"plan": path.name})
        path.write_text(json.dumps(self.to_dict(mechanism_path.name), indent=2) + "\n")
        return path

    @classmethod
    def from_json(cls, path: str | Path, *, progress: bool = True) -> "RunPlan":
        """Load a plan written by :meth:`to_json`, re-checking it (see the module docstring);
        ``progress``: a Monte Carlo guarantee verified afresh says so on stderr."""
        path = Path(path)
        doc = read_json_document(path, FORMAT, VERSION, "plan", "plan file")
        try:
            return _load(doc, path, progress)
        except CorrnoiseError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CorrnoiseError("plan", f"{str(path)!r} is malformed ({type(exc).__name__}: {exc})") from None


def check_plan_path(path: str | Path, param: str = "plan") -> Path:
    """``path`` as a Path if it names a plan file (``.json``), else a one-line error naming ``param``."""
    path = Path(path)
    if path.suffix != ".json":
        raise CorrnoiseError(param, f"plan files end in .json, got {str(path)!r}")
    return path


def _load(doc: dict[str, Any], path: Path, progress: bool = True) -> RunPlan:
    mechanism = doc["mechanism"]
    if not isinstance(mechanism, dict) or not isinstance(mechanism.get("file"), str):
        raise CorrnoiseError("mechanism", "the plan names no mechanism file")
    strategy = load_mechanism(path.parent / mechanism["file"])
    if mechanism_fingerprint(strategy) != doc["fingerprint"]:
        raise CorrnoiseError("mechanism", f"{mechanism['file']!r} is not the plan's mechanism (its fingerprint differs "
                             "from the recorded one: the file changed since the plan was made)")
    sampler = SamplerSpec.from_dict(doc["sampler"])
    sizes = {"dataset_size": sampler.num_examples, "batch_size": sampler.batch_size, "steps": sampler.steps}
    for name, value in sizes.items():
        if doc[name] != value:
            raise CorrnoiseError(name, f"the plan says {doc[name]!r} but its sampler was made for {value!r}")
    batching = parse_batching(doc["batching"], doc.get("participation"))
    desc = sampler.description
    own = parse_batching(desc["accounting"], desc["participation"] if desc["accounting"] == "none" else None)
    if own != batching:
        raise CorrnoiseError("batching", f"the plan accounts {batching.spec} but its sampler forms {own.spec}")
    if sampler.name is not None:
        sampler.build(0)  # the sampler it names is the one it describes (any seed: the description has none)
    options = doc.get("accounting_options") or {}
    refuse_non_guarantees(options)
    noise_std = check_real("noise_std", doc["noise_std"], low=0.0, low_open=True)
    delta = check_real("delta", doc["delta"], low=0.0, high=1.0, low_open=True, high_open=True)
    event = MechanismEvent(strategy, batching, noise_std=noise_std, steps=check_int("steps", doc["steps"], minimum=1))
    method = prepare(event.without_noise(), doc.get("accounting_method", "auto")).name
    if method != doc["method"]:
        raise CorrnoiseError("method", f"the plan says {doc['method']!r} but the gate chooses {method!r} for this run")
    guarantee = None if doc["guarantee"] is None else reproved_guarantee(
        _checked_guarantee(doc["guarantee"], event, delta), event, method, options, "corrnoise plan file", progress)
    epochs = doc.get("epochs")
    epochs = None if epochs is None else check_real("epochs", epochs, low=0.0, low_open=True)
    candidates = tuple(doc.get("candidates") or ())
    per_epoch = check_int("steps_per_epoch", doc["steps_per_epoch"], minimum=1)
    _check_descriptions(doc, strategy, sampler, event, epochs, per_epoch, candidates)
    plan = RunPlan(strategy, sampler, event, method, guarantee, sampler.num_examples, sampler.batch_size, epochs,
                   per_epoch, delta, doc.get("accounting_method", "auto"), dict(options),
                   _label(doc.get("label"), strategy, event, candidates), doc.get("pipeline"), candidates)
    method_of_noise = doc.get("noise_method", "auto")
    if method_of_noise not in ("auto", "regenerate"):
        raise CorrnoiseError("noise_method", f"must be 'auto' or 'regenerate', got {method_of_noise!r}")
    plan = replace(plan, noise_method=method_of_noise)
    recorded = doc.get("noise_multiplier")
    if recorded is not None and not math.isclose(float(recorded), plan.noise_multiplier, rel_tol=1e-9):
        raise CorrnoiseError("noise_multiplier", f"the plan says {recorded!r} but its noise_std and mechanism give "
                             f"{plan.noise_multiplier!r}")
    return plan


# --- the descriptive fields: what a plan says about its content must be what the content is -------
#: the message of a descriptive field that contradicts the plan's content
_EDITED = "the plan was edited (plan again, or restore the field)"


def _check_descriptions(doc, strategy: Strategy, sampler: SamplerSpec, event: MechanismEvent, epochs, per_epoch: int,
                        candidates: tuple) -> None:
    """Refuse (one line naming the field) a descriptive field of a plan file that contradicts its
    content: ``mechanism.label`` (the mechanism file's own label), ``pipeline`` (a pipeline that
    forms the plan's batches), ``epochs`` (a length that gives the plan's steps) and
    ``steps_per_epoch`` (the loader pass those give). Found by a user probe: a plan edited to
    ``pipeline: cyclic`` beside balls-in-bins batches, or to 10 epochs of 11 steps, was accepted
    and reported as such. ``label`` is :func:`_label`'s."""
    named = doc["mechanism"].get("label")
    if named is not None and named != strategy.label:
        raise CorrnoiseError("mechanism", f"the plan names {named!r} but its mechanism file holds {strategy.label} "
                             f"(fingerprint {mechanism_fingerprint(strategy)[:16]}): {_EDITED}")
    batching, steps = event.batching, event.steps
    pipeline = doc.get("pipeline")
    if pipeline is not None:  # None: planned with a ready sampler (or not recorded)
        from ..pipelines import PIPELINES, pipeline_spec_heads

        if pipeline not in PIPELINES or batching.head not in pipeline_spec_heads(pipeline):
            raise CorrnoiseError("pipeline", f"the plan says {pipeline!r} but its batches are {batching.spec} "
                                 f"({sampler.name or 'a ready sampler'}), which that pipeline does not form: {_EDITED}")
    if epochs is not None and sampler.name is not None and not _gives_steps(sampler, epochs, steps):
        raise CorrnoiseError("epochs", f"the plan says {epochs:g} epochs but its {sampler.name} sampler runs {steps} "
                             f"steps on {sampler.num_examples} examples in batches of {sampler.batch_size}: {_EDITED}")
    natural = batching.bins if isinstance(batching, BallsInBins) else max(1, round(sampler.num_examples /
                                                                                   sampler.batch_size))
    # plan_run: steps / epochs where epochs were given, else a natural epoch; a planner's pick is
    # given in steps (plan_choice), so its pass stays the natural one
    derived = {math.ceil(steps / float(epochs) - 1e-9)} if epochs is not None else {natural}
    if candidates:
        derived.add(natural)
    if per_epoch not in derived:
        raise CorrnoiseError("steps_per_epoch", f"the plan says {per_epoch} but its {steps} steps"
                             f"{f' in {epochs:g} epochs' if epochs is not None else ''} give "
                             f"{' or '.join(map(str, sorted(derived)))}: {_EDITED}")


def _gives_steps(sampler: SamplerSpec, epochs: float, steps: int) -> bool:
    """Whether ``epochs`` of this sampler's run is ``steps`` steps: as the sampler forms them
    (:func:`corrnoise.sampling.make_sampler`), or whole epochs of N // B steps (the planner's)."""
    if float(epochs).is_integer() and steps == int(epochs) * max(1, sampler.num_examples // sampler.batch_size):
        return True
    try:
        return make_sampler(sampler.name, sampler.blocks, sampler.num_examples, sampler.batch_size, epochs=epochs,
                            seed=0).steps == steps
    except CorrnoiseError:
        return False


def _label(label: Any, strategy: Strategy, event: MechanismEvent, candidates: tuple) -> str:
    """The plan's ``label`` (the mechanism as named, for people: what a run reports as its
    mechanism) if it names this mechanism by content: the mechanism's own label, a name that
    builds it (``dpsgd``, ``bsr:2``: same fingerprint) or the planner's name of the candidate the
    plan trains (``bandmf:16``: its candidate of this mechanism, batching and noise). A mechanism
    file's path that no longer reads as this mechanism gives way to the mechanism's own label;
    any other name is refused in one line (a user probe relabelled a BandMF plan ``dpsgd``, and
    training reported DP-SGD)."""
    if label is None or label == "" or label == strategy.label:
        return strategy.label
    if not isinstance(label, str):
        raise CorrnoiseError("label", f"must be a string, got {label!r}")
    fingerprint = mechanism_fingerprint(strategy)
    try:
        named = mechanism_fingerprint(parse_strategy(label, event.steps))
    except CorrnoiseError:
        named = None  # not a name that builds a mechanism (a planner's bandmf:16, a file)
    if named is not None:  # a name of a mechanism is that mechanism, whatever the candidates list says
        if named == fingerprint:
            return label
    elif any(isinstance(c, dict) and c.get("mechanism") == label and c.get("strategy") == strategy.label
             and c.get("final") and c.get("batching") == event.batching.spec and c.get("noise_std") == event.noise_std
             for c in candidates):
        return label
    if label.endswith((".json", ".npy")):  # a file's path is a name, not an identity: the content's label
        return strategy.label
    raise CorrnoiseError("label", f"the plan says {label!r} but its mechanism is {strategy.label} (fingerprint "
                         f"{fingerprint[:16]}), which {label!r} does not name: {_EDITED}")


def _checked_guarantee(data: Any, event: MechanismEvent, delta: float) -> PrivacyResult:
    """The plan's guarantee if it is a formal one of exactly this run, noise and delta."""
    guarantee = PrivacyResult.from_dict(data)
    if guarantee.kind != "guarantee":
        raise CorrnoiseError("guarantee", f"is of kind {guarantee.kind!r}: only a formal guarantee calibrates noise")
    identity = run_identity(event)
    why = run_mismatch(guarantee, {"mechanism": event.mechanism.label, **identity})
    if why is not None:
        key = next((k for k in RUN_IDENTITY_KEYS if guarantee.extras.get(k) != identity.get(k)), "fingerprint")
        raise CorrnoiseError(_FIELD_OF_IDENTITY[key], f"the plan's guarantee was computed for {why}")
    if guarantee.noise_std != event.noise_std:
        raise CorrnoiseError("noise_std", f"the plan says {event.noise_std!r} but its guarantee was calibrated for "
                             f"{guarantee.noise_std!r}")
    if guarantee.delta > delta:
        raise CorrnoiseError("delta", f"the plan's guarantee has delta {guarantee.delta:g} > the plan's {delta:g}")
    return guarantee
