"""The planner's family registry: a designable family registers its designs once
(:func:`design_family`, used in :mod:`.designs`); the names (``--only``, ``FAMILIES``) and which
families may regenerate their noise are read from here, never listed elsewhere."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["design_family", "families", "family_designs", "regenerable_families"]

#: family name -> fn(ctx) -> [(label, build), ...], in registration order (the planner's order)
_FAMILY_DESIGNS: dict[str, Callable[[Any], list]] = {}
_REGENERABLE: list[str] = []


def design_family(name: str, *, regenerable: bool = False):
    """Register ``fn(ctx) -> [(label, build), ...]`` as the planner family ``name``: the one place
    a designable family is added to the planner (its name, ``--only``, its builds).
    ``regenerable``: its buffered noise may be switched to regenerated noise (tutorial Sec. 4.4.5,
    Approach 2: C^{-1} regenerated from the key, no model-size buffers) when a noise memory budget
    does not fit the buffers (:mod:`.budget`)."""
    def register(fn):
        _FAMILY_DESIGNS[name] = fn
        if regenerable and name not in _REGENERABLE:
            _REGENERABLE.append(name)
        return fn
    return register


def families() -> tuple[str, ...]:
    """The registered family names, in the planner's order."""
    return tuple(_FAMILY_DESIGNS)


def regenerable_families() -> tuple[str, ...]:
    return tuple(_REGENERABLE)


def family_designs(name: str) -> Callable[[Any], list]:
    return _FAMILY_DESIGNS[name]
