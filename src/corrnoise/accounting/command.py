"""``corrnoise account`` (DESIGN.md "Command-line contract").

    corrnoise account MECHANISM --n N --batching SPEC (--sigma S | --noise-std NU | --epsilon E)
        --delta D [--participation ...] [--method auto|gaussian|pld|rdp|bandmf|mmcc|mc]
        [--samples S] [--seed S] [--verify] [--lower-bound] [--json]

prints ``epsilon, delta, noise_std, noise_multiplier, method`` and the method's extras
(``gdp_mu`` when unamplified; ``delta_add, delta_remove, std_error_*, samples, verified`` for
Monte Carlo).  With ``--epsilon`` the noise is calibrated (smallest noise_std reaching it).
"""

from __future__ import annotations

import math
import sys

import click

from ..errors import CorrnoiseError
from ..report import emit

METHOD_CHOICES = ["auto", "gaussian", "pld", "rdp", "bandmf", "mmcc", "mc"]


def _jsonable(data: dict) -> dict:
    out = {}
    for key, value in data.items():
        if hasattr(value, "item"):  # numpy scalars
            value = value.item()
        out[key] = value
    return out


@click.command("account")
@click.argument("mechanism")
@click.option("--n", "n", type=int, required=True, help="Number of steps (iterations).")
@click.option("--batching", required=True,
              help="none | poisson:P | block-cyclic:BLOCKS:P | balls-in-bins:BINS")
@click.option("--participation", default=None,
              help="With --batching none: single | cyclic:K:B | minsep:K:B (default single).")
@click.option("--sigma", "sigma", type=float, default=None,
              help="Noise multiplier sigma = noise_std / ||C||_col.")
@click.option("--noise-std", "noise_std", type=float, default=None,
              help="Standard deviation nu of each entry of Z, in clip-norm units.")
@click.option("--epsilon", "epsilon", type=float, default=None,
              help="Target epsilon: calibrate the smallest noise reaching it.")
@click.option("--delta", "delta", type=float, required=True, help="Target delta, in (0, 1).")
@click.option("--method", type=click.Choice(METHOD_CHOICES), default="auto", show_default=True,
              help="Accounting method (auto picks by batching and mechanism).")
@click.option("--samples", type=int, default=None, help="Monte Carlo samples (method mc).")
@click.option("--seed", type=int, default=None,
              help="Monte Carlo seed, for reproducible experiments only (retrying with one seed re-uses its "
                   "verification sample and voids the failure probability). Default: fresh OS entropy, recorded "
                   "in the output.")
@click.option("--verify", is_flag=True, default=False,
              help="Monte Carlo: formally verify with fresh samples (Estimate-Verify-Release; the default).")
@click.option("--lower-bound", "lower_bound", is_flag=True, default=False,
              help="MMCC: report the lower bound (p_tilde = p) that shows how tight MMCC is.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def account_command(mechanism: str, n: int, batching: str, participation: str | None, sigma: float | None,
                    noise_std: float | None, epsilon: float | None, delta: float, method: str,
                    samples: int | None, seed: int | None, verify: bool, lower_bound: bool,
                    as_json: bool) -> None:
    """(epsilon, delta) of MECHANISM for a noise level, or the noise for a target epsilon."""
    from ..strategies import parse_strategy
    from . import account, calibrate, parse_batching
    from .base import choose_method

    if n < 1:
        raise CorrnoiseError("n", f"must be >= 1, got {n}")
    given = [name for name, value in (("--sigma", sigma), ("--noise-std", noise_std), ("--epsilon", epsilon))
             if value is not None]
    if len(given) != 1:
        raise CorrnoiseError("noise", "give exactly one of --sigma, --noise-std or --epsilon"
                             + (f" (got {' and '.join(given)})" if given else ""))
    if samples is not None and samples < 1:
        raise CorrnoiseError("samples", f"must be >= 1, got {samples}")
    spec = parse_batching(batching, participation)
    strategy = parse_strategy(mechanism, n)
    options = {"samples": samples, "seed": seed, "progress": (not as_json) and sys.stderr.isatty(),
               "verify": True if verify else None, "lower_bound": True if lower_bound else None}
    chosen = choose_method(strategy, spec) if method == "auto" else method
    for flag, name, methods in (("--verify", "verify", ("mc",)), ("--lower-bound", "lower_bound", ("mmcc",))):
        if options[name] and chosen not in methods:  # never drop a requested guarantee silently
            raise CorrnoiseError(name, f"{flag} applies to --method {'/'.join(methods)} only "
                                       f"(this mechanism and batching use {chosen})")
    if lower_bound and epsilon is not None:  # a lower bound on epsilon cannot size the noise
        raise CorrnoiseError("lower_bound", "--lower-bound reports how tight MMCC is for a given noise; "
                                            "calibrating noise to it would give no guarantee (use --sigma/--noise-std)")
    if epsilon is not None:
        result = calibrate(strategy, spec, epsilon=epsilon, delta=delta, method=method, **options)
    else:
        result = account(strategy, spec, delta=delta, noise_std=noise_std, noise_multiplier=sigma,
                         method=method, **options)
    if not math.isfinite(result.epsilon):
        raise CorrnoiseError("noise", f"epsilon is infinite at delta={result.delta:g} for noise_std="
                             f"{result.noise_std:g}; increase the noise or delta")
    if verify and result.extras.get("verified") is not True:
        # Estimate-Verify-Release (seed 000 Thm 2.1): nothing is released when verification fails.
        raise CorrnoiseError("verify", f"the Monte Carlo estimate (epsilon={result.epsilon:g}, delta={result.delta:g}) "
                                       "failed verification on fresh samples; increase the noise or --samples")
    data = _jsonable(result.to_dict())
    emit(data, as_json, f"corrnoise account {mechanism}")


