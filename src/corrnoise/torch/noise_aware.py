"""AdamW that knows the noise: the released noise's variance taken out of Adam's second moment.

The idea is DP-AdamBC's (Tang et al., AAAI 2024, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD
(Unless You Apply Bias Correction)"): under DP the gradient Adam sees is g_hat = g + n with the
noise n independent of g (DP-SGD), so its second moment estimates E[g^2] + Var(n); when the noise
dominates, sqrt(v) is the noise's scale, the same for every coordinate, and Adam behaves like SGD
with a fixed step.
The noise's variance is public (it follows from the mechanism and the noise scale, never from
the data), so it can be subtracted: the update uses max(v_hat - phi_hat, floor) instead of v_hat.

The variance of the released noise at step t (:func:`released_noise_variance`, the one place
with the formula) comes from the privatizer's release (tutorial Alg. 3.1, lines 7-8,
:mod:`.privatizer`): g_hat_t = (S_t + zeta nu (C^{-1} Z)[t]) / B. For a correlated mechanism it
changes with t (the rows of C^{-1} have different norms), so the optimizer keeps it in an
exponential average with Adam's beta2, bias-corrected like v: phi_hat_t is then exactly the
noise's own contribution to E[v_hat_t]. Under DP-SGD the noise is independent of the gradient and
E[v_hat] = E[g^2] + phi_hat; a correlated noise row is correlated with earlier rows, which moved
the parameters, so a cross term remains that the subtraction does not model.

Used through :func:`corrnoise.torch.make_private`: pass a :class:`NoiseAwareAdamW` as the
optimizer, and the private optimizer tells it each step's variance (:meth:`observe_noise_variance`)
before its update. With variance 0 the update is exactly AdamW's (torch.optim.AdamW, amsgrad off).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CorrnoiseError, check_int, check_real

__all__ = ["NoiseAwareAdamW", "ema_noise_sd", "noise_row_norms_squared", "released_noise_variance"]


def released_noise_variance(row_norm_squared: float, noise_std: float, clip_norm: float,
                            expected_batch_size: float) -> float:
    """Variance of every coordinate of the noise in the released (averaged) gradient at step t.

    The release is g_hat_t = (S_t + zeta * nu * (C^{-1} Z)[t]) / B (tutorial Alg. 3.1, lines 7-8;
    :func:`corrnoise.torch.privatizer.privatize_sum`) with Z standard normal, independent across
    steps and coordinates, so each coordinate of the noise term has variance

        Var_t = zeta^2 nu^2 ||C^{-1}[t, :]||^2 / B^2

    ``row_norm_squared`` = ||C^{-1}[t, :]||^2 (:func:`noise_row_norms_squared`), ``noise_std`` = nu,
    ``clip_norm`` = zeta, ``expected_batch_size`` = B (the fixed divisor, also with "mean" loss
    reduction: the engine's sums are of per-example gradients either way). DP-SGD (C = I): nu^2
    zeta^2 / B^2 at every step.
    """
    return float(clip_norm) ** 2 * float(noise_std) ** 2 * float(row_norm_squared) / float(expected_batch_size) ** 2


def noise_row_norms_squared(strategy) -> np.ndarray:
    """||C^{-1}[t, :]||^2 for every step t, shape (n,): the rows of the matrix that correlates the noise.

    A lower-triangular Toeplitz C has a Toeplitz inverse with first column h = C^{-1} e_0, so row t's
    norm is sum_{k <= t} h_k^2 (one pass of the inverse stream); any other C (column-normalized
    ones included): from C^{-1} materialized (:meth:`Strategy.noising_matrix`, n x rows).
    """
    if strategy.toeplitz_coefficients is not None and not strategy.column_normalized:
        e0 = np.zeros(strategy.n)
        e0[0] = 1.0
        return np.cumsum(np.asarray(strategy.inverse_multiply(e0), dtype=np.float64) ** 2)
    return np.sum(np.asarray(strategy.noising_matrix(), dtype=np.float64) ** 2, axis=1)


def ema_noise_sd(noise_variance: float, beta2: float, step: int) -> float:
    """Standard deviation of Adam's bias-corrected second moment v_hat_k when the gradient is noise alone.

    With g_j ~ N(0, phi) independent, g_j^2 has variance 2 phi^2, and v_hat_k = sum_j w_j g_j^2 with
    w_j = (1 - beta2) beta2^(k-j) / (1 - beta2^k), so Var(v_hat_k) = 2 phi^2 sum_j w_j^2 =
    2 phi^2 (1 - beta2)(1 + beta2^k) / ((1 + beta2)(1 - beta2^k)): phi sqrt(2) at step 1, about
    phi sqrt(2 (1 - beta2) / (1 + beta2)) (0.032 phi for beta2 = 0.999) once k >> 1 / (1 - beta2).
    Correlated noise rows (n_t of C^-1 Z) make the squares correlated across steps, and the spread
    larger than this i.i.d. value: the floor it sets is a heuristic, not a bound.
    """
    phi = check_real("noise_variance", noise_variance, low=0.0)
    b = check_real("beta2", beta2, low=0.0, high=1.0, high_open=True)
    k = check_int("step", step, minimum=1)
    return phi * float(np.sqrt(2.0 * (1.0 - b) * (1.0 + b ** k) / ((1.0 + b) * (1.0 - b ** k))))


class NoiseAwareAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose second moment is corrected for
    the known variance of the DP noise (DP-AdamBC's idea; see the module docstring).

    Per parameter, with g the released gradient and phi_t the variance of its noise at step t
    (given by :meth:`observe_noise_variance`, 0 if never given)::

        p      <- p (1 - lr * weight_decay)
        m      <- beta1 m + (1 - beta1) g          m_hat   = m / (1 - beta1^k)
        v      <- beta2 v + (1 - beta2) g^2        v_hat   = v / (1 - beta2^k)
        a      <- beta2 a + (1 - beta2) phi_t      phi_hat = a / (1 - beta2^k)
        floor  = max(variance_floor, floor_z * ema_noise_sd(phi_hat, beta2, k))
        p      <- p - lr m_hat / (sqrt(max(v_hat - phi_hat, min(floor, v_hat))) + eps)

    The floor. Where the gradient is all noise, v_hat - phi_hat is zero give or take the EMA's own
    spread (:func:`ema_noise_sd`), so without a floor the step would divide by ~0 and be huge
    (measured: with a fixed floor of 1e-10 text fine-tuning fell to chance, RESULTS.md). The
    corrected moment is kept at least ``floor_z`` (default 2) of those standard deviations, and at
    least ``variance_floor`` (default 1e-10, squared gradient units), so a noise-only coordinate
    steps at most about sqrt(phi / (floor_z * ema_noise_sd)) times AdamW's step: ~4x for
    beta2 = 0.999 late in training; at step 1 the floor lies above v_hat, so the step is AdamW's.
    The floor never raises the moment above the uncorrected v_hat (never a smaller step than
    AdamW's). ``floor_z=0`` leaves the fixed floor alone, as does a state dict saved before
    ``floor_z`` existed (its param groups lack it: a resumed run keeps the update it started with).
    With phi = 0 the update is AdamW's exactly.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, variance_floor: float = 1e-10, floor_z: float = 2.0):
        lr = check_real("lr", lr, low=0.0)
        eps = check_real("eps", eps, low=0.0)
        weight_decay = check_real("weight_decay", weight_decay, low=0.0)
        variance_floor = check_real("variance_floor", variance_floor, low=0.0, low_open=True)
        floor_z = check_real("floor_z", floor_z, low=0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise CorrnoiseError("betas", f"must be a pair (beta1, beta2), got {betas!r}")
        betas = (check_real("betas", betas[0], low=0.0, high=1.0, high_open=True),
                 check_real("betas", betas[1], low=0.0, high=1.0, high_open=True))
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      variance_floor=variance_floor, floor_z=floor_z))
        self.noise_variance = 0.0

    def observe_noise_variance(self, variance: float) -> None:
        """The variance of each coordinate of the noise in the gradients of the next :meth:`step`
        (:func:`released_noise_variance`; the private optimizer calls this every step)."""
        self.noise_variance = check_real("variance", variance, low=0.0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        phi = self.noise_variance
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, p.grad, group, beta1, beta2, phi)
        return loss

    def _update(self, p, grad, group, beta1, beta2, phi):
        """One AdamW step of parameter ``p`` with the noise-variance correction."""
        if grad.is_sparse:
            raise CorrnoiseError("params", "NoiseAwareAdamW does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["noise_avg_sq"] = 0.0
        state["step"] += 1
        k = state["step"]
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1.0 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        state["noise_avg_sq"] = beta2 * state["noise_avg_sq"] + (1.0 - beta2) * phi
        denom = _corrected(v, state["noise_avg_sq"], group, beta2, k).sqrt_().add_(group["eps"])
        p.addcdiv_(m, denom, value=-group["lr"] / (1.0 - beta1 ** k))

    def corrected_second_moment(self, p: torch.Tensor) -> torch.Tensor:
        """max(v_hat - phi_hat, min(floor, v_hat)) of parameter ``p`` after the last step."""
        state = self.state.get(p)
        if not state:
            raise CorrnoiseError("p", "has taken no step")
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        return _corrected(state["exp_avg_sq"], state["noise_avg_sq"], group, group["betas"][1], state["step"])


def _corrected(v: torch.Tensor, noise_avg_sq: float, group, beta2: float, step: int) -> torch.Tensor:
    """max(v_hat - phi_hat, min(floor, v_hat)) with v_hat, phi_hat the bias-corrected averages at
    ``step`` and floor = max(variance_floor, floor_z * ema_noise_sd(phi_hat, beta2, step)) (see
    :class:`NoiseAwareAdamW`); v_hat itself where no noise was observed. A new tensor."""
    bc2 = 1.0 - beta2 ** step
    v_hat, phi_hat = v / bc2, noise_avg_sq / bc2
    if phi_hat <= 0.0:
        return v_hat
    floor = max(group["variance_floor"], group.get("floor_z", 0.0) * ema_noise_sd(phi_hat, beta2, step))
    return torch.maximum(v_hat - phi_hat, v_hat.clamp(max=floor))
