"""ml-cvnets' classification loop on the 8x8 digits: the digits CNN, data and label smoothing,
with every BatchNorm layer's momentum set each step from a named schedule (cvnets'
``adjust_bn_momentum``). Accumulation from an epoch on, the max-iterations stop, the per-iteration
lr with warm-up, AMP, unscale-then-clip and the model EMA are engine settings of the recipe
(``recipes/cvnets_cls.yaml``)."""

from __future__ import annotations

from torch import nn

from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.digits import DigitsTask

BN_MOMENTUM = "bn_momentum"


def set_bn_momentum(model: nn.Module, momentum: float) -> None:
    """Set the momentum of every BatchNorm layer of ``model`` (PyTorch's convention: the weight of
    the new batch's statistics in the running ones)."""
    for layer in model.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.momentum = momentum


class CvnetsTask(DigitsTask):
    """The digits task whose criterion first applies this step's ``schedules.bn_momentum`` to the
    model's BatchNorm layers, so their running statistics follow cvnets' momentum schedule."""

    def criterion(self, model: nn.Module, batch, ctx: StepContext) -> LossOutput:
        if BN_MOMENTUM not in ctx.values:
            raise ValueError(
                f"task 'cvnets' sets BatchNorm momentum from schedules.{BN_MOMENTUM}, which the config lacks; "
                f"add e.g. schedules.{BN_MOMENTUM}: {{kind: cosine, value: 0.1, end: 0.01}}"
            )
        momentum = ctx.values[BN_MOMENTUM]
        set_bn_momentum(model, momentum)
        out = super().criterion(model, batch, ctx)
        out.logs[BN_MOMENTUM] = momentum
        return out
