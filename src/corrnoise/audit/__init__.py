"""Empirical privacy auditing (issue #28): measured *lower bounds* on epsilon, torch-free.

Every number here is an :class:`AuditResult` whose ``kind`` says what it is: ``lower_bound``
(valid at ``confidence`` whatever the mechanism) or ``estimate`` (the GDP fit, resting on a
Gaussian assumption). Neither is a guarantee; a lower bound above a run's guarantee is evidence
that the run (its noise, its accounting) is broken.

* :func:`many_run_audit` / :func:`many_run_audit_features`: independent runs with and without a
  canary, a threshold test on sample-split runs, Clopper-Pearson bounds on FPR/FNR ->
  eps lower bound (:mod:`.many_run`);
* :func:`one_run_audit`: m fair-coin canaries in one run (Steinke, Nasr & Jagielski 2023,
  :mod:`.one_run`); with ``gdp=True`` also a lower bound on the run's GDP parameter
  (:func:`one_run_mu_lower`);
* :mod:`.stats`: Clopper-Pearson, the hypothesis-testing bound, AUC, TPR at low FPR, GDP fit.

Canaries on the real training path (PyTorch) are in :mod:`corrnoise.torch.audit`.
"""

from .many_run import fit_linear_score, gdp_estimate, many_run_audit, many_run_audit_features
from .one_run import (one_run_audit, one_run_epsilon_lower, one_run_gdp_p_value, one_run_guesses, one_run_mu_lower,
                      one_run_p_value)
from .result import AUDIT_KINDS, AuditResult
from .stats import (auc_interval, clopper_pearson, clopper_pearson_upper, epsilon_from_rates, gdp_mu_from_scores,
                    roc_auc, tpr_at_fpr)

__all__ = [
    "AUDIT_KINDS", "AuditResult", "auc_interval", "clopper_pearson", "clopper_pearson_upper", "epsilon_from_rates",
    "fit_linear_score", "gdp_estimate", "gdp_mu_from_scores", "many_run_audit", "many_run_audit_features",
    "one_run_audit", "one_run_epsilon_lower", "one_run_gdp_p_value", "one_run_guesses", "one_run_mu_lower",
    "one_run_p_value", "roc_auc", "tpr_at_fpr",
]
