"""ml-cvnets' classification loop: a CNN, label smoothing, and every BatchNorm layer's momentum set
each step from a named schedule (cvnets' ``adjust_bn_momentum``). Accumulation from an epoch on,
the max-iterations stop, the per-iteration lr with warm-up, AMP, unscale-then-clip and the model
EMA are engine settings of the recipe (``recipes/cvnets_cls.yaml``).

``task.params.data``: ``digits`` (the default: scikit-learn's 8x8 digits, generated, no
download) or ``imagefolder``: the set ``raytrain-loops convert imagefolder`` wrote at
``task.params.source``, its images decoded in ``preprocess`` at ``task.params.size`` with
cvnets' random resized crop and horizontal flip (the evaluation: resize and centre crop), its
channels and classes taken from the data. ``task.params.backbone_weights``: a file whose weights
the CNN's backbone starts from (a DINO run's exported teacher, ``raytrain-loops export --ema``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.data.formats import images as views
from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.engine import LossOutput, StepContext
from raytrain_loops.tasks.base import ParquetSplit, params_at_least
from raytrain_loops.tasks.digits import DigitsTask, SmallCNN

BN_MOMENTUM = "bn_momentum"
DATA = ("digits", "imagefolder")


def by_data(cls: type, base: type, folder: type, data: str) -> type:
    """The class a ``task.params.data`` value makes: ``folder`` for ``imagefolder`` when ``base``
    itself is named (a subclass stays itself), ``cls`` otherwise; an unknown value refused."""
    if data not in DATA:
        raise ConfigError("task.params.data", f"must be one of {list(DATA)}; got {data!r}")
    return folder if cls is base and data == "imagefolder" else cls


def set_bn_momentum(model: nn.Module, momentum: float) -> None:
    """Set the momentum of every BatchNorm layer of ``model`` (PyTorch's convention: the weight of
    the new batch's statistics in the running ones)."""
    for layer in model.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.momentum = momentum


def load_backbone(backbone: nn.Module, path: str) -> None:
    """``backbone`` loaded from ``task.params.backbone_weights``
    (:func:`~raytrain_loops.checkpoint.load_backbone`); its errors name the key."""
    from raytrain_loops.checkpoint import WeightsError
    from raytrain_loops.checkpoint import load_backbone as load

    try:
        load(backbone, path)
    except WeightsError as err:
        raise ConfigError("task.params.backbone_weights", str(err)) from None


def with_backbone(model: nn.Module, path: str) -> nn.Module:
    """``model`` with its backbone (``features``) loaded from ``path`` when one is named."""
    if path:
        load_backbone(model.features, path)
    return model


class CvnetsTask(DigitsTask):
    """The digits task whose criterion first applies this step's ``schedules.bn_momentum`` to the
    model's BatchNorm layers, so their running statistics follow cvnets' momentum schedule.
    ``data=imagefolder`` makes a :class:`CvnetsFolderTask`."""

    def __new__(cls, *args: Any, data: str = "digits", **params: Any):
        return super().__new__(by_data(cls, CvnetsTask, CvnetsFolderTask, data))

    def __init__(
        self,
        width: int = 32,
        dropout: float = 0.1,
        label_smoothing: float = 0.0,
        shift: int = 1,
        data: str = "digits",
        backbone_weights: str = "",
    ):
        super().__init__(width, dropout, label_smoothing, shift)
        self.backbone_weights = backbone_weights

    def build_model(self) -> nn.Module:
        return with_backbone(super().build_model(), self.backbone_weights)

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


class CvnetsFolderTask(CvnetsTask):
    """cvnets' classification on a converted ImageFolder (``data=imagefolder``); see the module
    docstring. ``scale``: the random resized crop's range of area fractions (cvnets' 0.08 to 1)."""

    def __init__(
        self,
        width: int = 32,
        dropout: float = 0.1,
        label_smoothing: float = 0.0,
        data: str = "imagefolder",
        source: str = "",
        size: int = 32,
        scale: tuple[float, float] = (0.08, 1.0),
        backbone_weights: str = "",
    ):
        params_at_least(("size", size, 8), ("width", width, 1))
        super().__init__(width, dropout, label_smoothing, shift=0, backbone_weights=backbone_weights)
        self.images = views.ConvertedSet(source, "imagefolder")
        self.size, self.scale = size, tuple(scale)

    def prepare(self, data_dir: Path) -> None:
        self.images.meta  # noqa: B018  (read and checked on the driver, carried to the workers)

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        found = {name: self.images.split(name) for name in ("train", "eval")}
        return {name: ParquetSplit(path, ["image", "label"]) for name, path in found.items() if path}

    def data_digest(self) -> str:
        return self.images.digest

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        out = []
        for raw, seed in zip(batch["image"], batch[ROW_SEED], strict=True):
            image = views.decode(raw, self.images.channels)
            if train:
                rng = np.random.default_rng(int(seed))
                image = views.flip(views.random_resized_crop(image, self.size, self.scale, rng), rng)
            else:
                image = views.center_crop(image, self.size)
            out.append(views.chw(image))
        return {"image": np.stack(out), "label": np.asarray(batch["label"])}

    def collate(self, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.ascontiguousarray(batch["image"])).float().div_(255.0)
        return x, torch.as_tensor(np.asarray(batch["label"]), dtype=torch.long)

    def build_model(self) -> nn.Module:
        classes = len(self.images.meta["classes"])
        return with_backbone(SmallCNN(self.width, classes, self.dropout, self.images.channels), self.backbone_weights)
