"""PyTorch training with correlated noise (layer 6): per-example gradients, the privatizer,
the optimizer wrapper and ``make_private``, an Opacus adapter and sharded distributed noise.

    from corrnoise.torch import make_private
    private = make_private(model, optimizer, loss_fn, train_set, mechanism="bsr:4",
                           epsilon=8.0, delta=1e-5, batch_size=64, epochs=10)
    for x, y in private.data_loader:
        private.step(x, y)
    print(private.privacy_spent().epsilon)

The Opacus adapter (:mod:`corrnoise.torch.opacus_adapter`, extra ``opacus``) and the
distributed helpers (:mod:`corrnoise.torch.distributed`) are imported on demand.
"""

from .optimizer import Agreement, PrivateOptimizer, check_agreement, leading_strategy, make_private, make_sampler
from .per_example import clip_and_sum, clip_factors, clipped_gradient_sum, per_example_gradients, trainable_parameters
from .privatizer import Privatizer, privatize_sum

__all__ = [
    "Agreement", "PrivateOptimizer", "Privatizer", "check_agreement", "clip_and_sum", "clip_factors",
    "clipped_gradient_sum", "leading_strategy", "make_private", "make_sampler", "per_example_gradients",
    "privatize_sum", "trainable_parameters",
]
