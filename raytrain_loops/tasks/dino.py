"""DINO self-distillation on the 8x8 digits: the DINO seed loop at toy scale, labels unused; or,
``task.params.data=imagefolder``, on a converted ImageFolder (:class:`DinoFolderTask`).

Per image the student sees 2 global views and ``local_crops`` smaller crops, all cut and resized
with tensor operations (an affine grid and bilinear sampling, no torchvision); the teacher, the
engine's EMA of the student (``ctx.ema``, momentum ``schedules.ema_momentum``), sees only the 2
global views. The loss is the cross-entropy between the teacher's centred and sharpened output
(temperature ``schedules.teacher_temp``) and the student's, over every pair of a global view and
another view. The centre is a buffer of the student (checkpointed with it), updated after every
applied update with the mean of the teacher's outputs over the update's micro-batches on all
workers: the criterion returns their sum and count as ``LossOutput.stats``, which the engine
sums inside the step's own all-reduce (so no criterion call runs a collective, whatever the
number of calls per worker) and hands to :meth:`DinoTask.after_step`.
Collapse indicators are logged every step: ``teacher_entropy`` (of the targets; log(out_dim) when
uniform, 0 when one-hot), ``kl`` (teacher || student) and ``feature_std`` (below).

Evaluation is a k-NN classifier (cosine similarity, majority vote of the k nearest) on the
backbone's features: each test batch against the whole training split, whose features every
worker computes with the model being evaluated (the split is 1,347 images of 8x8, read once per
worker from the same Parquet file as the training data; with ``data.eval_batch_size`` at least
the test rows per worker, once per model and evaluation). Each evaluation also reports the same
k-NN on the run's own backbone as initialised (``knn_accuracy_init``), the baseline the training
must beat, and ``feature_std`` (per-dimension standard deviation of the L2-normalised test
features: near 0 when the features collapse).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_loops.config import ConfigError
from raytrain_loops.data.formats import images as image_views
from raytrain_loops.data.parquet import ROW_SEED
from raytrain_loops.engine import LossOutput, StepContext, unwrap
from raytrain_loops.tasks.base import EvalOutput, ParquetSplit, params_at_least
from raytrain_loops.tasks.cvnets import by_data
from raytrain_loops.tasks.digits import COLUMNS, DigitsTask, SmallCNN

TEACHER_TEMP = "teacher_temp"


# ---------------------------------------------------------------------- views


def random_resized_crops(
    x: torch.Tensor,
    size: int,
    scale: tuple[float, float],
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    max_rotation: float = 0.0,
) -> torch.Tensor:
    """One random crop of every image of ``x`` (N, C, H, W), covering a fraction in ``scale`` of the
    image's area with an aspect ratio in ``ratio``, rotated by up to ``max_rotation`` degrees and
    resized to ``size`` x ``size`` with bilinear sampling."""
    n = x.shape[0]
    u = torch.rand(n, 4, device=x.device)
    area = scale[0] + (scale[1] - scale[0]) * u[:, 0]
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[:, 1]
    # Half-widths in the [-1, 1] coordinates of affine_grid; the crop stays inside the image.
    w = torch.sqrt(area * log_r.exp()).clamp(max=1.0)
    h = torch.sqrt(area / log_r.exp()).clamp(max=1.0)
    cx = (1.0 - w) * (2.0 * u[:, 2] - 1.0)
    cy = (1.0 - h) * (2.0 * u[:, 3] - 1.0)
    angle = torch.deg2rad(max_rotation * (2.0 * torch.rand(n, device=x.device) - 1.0))
    cos, sin = angle.cos(), angle.sin()
    theta = torch.stack([torch.stack([w * cos, -h * sin, cx], 1), torch.stack([w * sin, h * cos, cy], 1)], 1)
    grid = F.affine_grid(theta, [n, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def jitter_intensity(x: torch.Tensor, strength: float) -> torch.Tensor:
    """Scale each image's contrast by a random factor in [1 - strength, 1 + strength]."""
    factor = 1.0 + strength * (2.0 * torch.rand(x.shape[0], 1, 1, 1, device=x.device) - 1.0)
    return (x * factor).clamp(0.0, 1.0)


# ---------------------------------------------------------------------- model


class NormalizedLinear(nn.Module):
    """A linear layer without bias whose rows are L2-normalised in the forward pass: DINO's
    weight-normalised last layer with its norm fixed at 1 (``norm_last_layer``)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, F.normalize(self.weight, dim=1))


class DinoHead(nn.Module):
    """MLP projection to a bottleneck, L2 normalisation, then the prototypes (``last_layer``)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, bottleneck_dim: int, use_bn: bool = False):
        super().__init__()

        def norm():
            return nn.BatchNorm1d(hidden_dim) if use_bn else nn.Identity()

        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            norm(),
            nn.GELU(),
            nn.Linear(hidden_dim, hidden_dim),
            norm(),
            nn.GELU(),
            nn.Linear(hidden_dim, bottleneck_dim),
        )
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.last_layer = NormalizedLinear(bottleneck_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.mlp(x), dim=-1))


class DinoModel(nn.Module):
    """A backbone (the digits CNN without its classifier), the DINO head, and the centre of the
    teacher's outputs (a buffer, so it is checkpointed with the student; the teacher's copy of it
    is not used)."""

    def __init__(
        self, width: int, out_dim: int, hidden_dim: int, bottleneck_dim: int, use_bn: bool = False, in_channels: int = 1
    ):
        super().__init__()
        cnn = SmallCNN(width, in_channels=in_channels)
        self.backbone = cnn.features
        self.head = DinoHead(cnn.feature_dim, out_dim, hidden_dim, bottleneck_dim, use_bn)
        self.register_buffer("center", torch.zeros(out_dim))

    def forward(self, *views: torch.Tensor) -> torch.Tensor:
        """Head outputs of every view, in order; each view tensor is one resolution (as in DINO's
        multi-crop wrapper: one backbone pass per resolution, one head pass for all)."""
        return self.head(torch.cat([self.backbone(v) for v in views]))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features, as used by the k-NN evaluation."""
        return self.backbone(x)


# ---------------------------------------------------------------------- loss and evaluation


def dino_loss(
    student_out: torch.Tensor,
    teacher_out: torch.Tensor,
    center: torch.Tensor,
    n_views: int,
    student_temp: float,
    teacher_temp: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DINO's loss and the teacher's target distributions.

    ``student_out`` holds ``n_views`` chunks of equal size (the 2 global views first),
    ``teacher_out`` 2 chunks (the global views). The loss is the mean over every pair of a teacher
    view and a different student view of the cross-entropy between the teacher's centred, sharpened
    softmax and the student's softmax.
    """
    student = F.log_softmax(student_out.float() / student_temp, dim=-1).chunk(n_views)
    targets = F.softmax((teacher_out.float() - center) / teacher_temp, dim=-1).detach()
    total = student_out.new_zeros((), dtype=torch.float32)
    pairs = 0
    for iq, q in enumerate(targets.chunk(2)):
        for v, s in enumerate(student):
            if v != iq:
                total = total - (q * s).sum(-1).mean()
                pairs += 1
    return total / pairs, targets


def center_stats(teacher_out: torch.Tensor) -> torch.Tensor:
    """The teacher outputs' sum and count, ``[sum..., n]``: summable over micro-batches and workers."""
    out = teacher_out.detach().float()
    return torch.cat([out.sum(0), out.new_tensor([out.shape[0]])])


@torch.no_grad()
def update_center(center: torch.Tensor, sums: torch.Tensor, momentum: float) -> None:
    """``center = momentum * center + (1 - momentum) * mean``, the mean from ``sums``
    (:func:`center_stats` summed over every micro-batch and worker); nothing when it counts none."""
    if sums[-1] > 0:
        center.mul_(momentum).add_((sums[:-1] / sums[-1]).to(center.dtype), alpha=1.0 - momentum)


def feature_std(features: torch.Tensor) -> torch.Tensor:
    """Mean over dimensions of the batch standard deviation of the L2-normalised features: about
    ``1/sqrt(dim)`` for features spread over the sphere, 0 for collapsed ones."""
    return F.normalize(features.float(), dim=-1).std(0).mean()


def knn_accuracy(
    bank: torch.Tensor, bank_labels: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, k: int
) -> torch.Tensor:
    """Accuracy of a k-nearest-neighbour vote (cosine similarity, majority of the ``k`` nearest
    samples of the bank) on ``features``."""
    sim = F.normalize(features.float(), dim=-1) @ F.normalize(bank.float(), dim=-1).T
    nearest = bank_labels[sim.topk(k, dim=1).indices]
    votes = torch.zeros(len(features), int(bank_labels.max()) + 1, device=features.device)
    votes.scatter_add_(1, nearest, torch.ones_like(nearest, dtype=votes.dtype))
    return (votes.argmax(1) == labels).float().mean()


# ---------------------------------------------------------------------- the task


class DinoTask(DigitsTask):
    """Self-distillation of the digits CNN with a DINO head; evaluated by k-NN on its features.
    The data (Parquet writer, splits, collate) is the digits task's.

    Reads ``schedules.teacher_temp`` from ``ctx.values`` and needs ``ema.enabled=true`` (the
    teacher) with ``ema.buffers=keep``: the teacher normalises with its own batch statistics
    in training, as in DINO, and keeps its own running statistics for evaluation.
    ``data=imagefolder`` makes a :class:`DinoFolderTask`.
    """

    def __new__(cls, *args: Any, data: str = "digits", **params: Any):
        return super().__new__(by_data(cls, DinoTask, DinoFolderTask, data))

    def __init__(
        self,
        width: int = 32,
        out_dim: int = 1024,
        hidden_dim: int = 256,
        bottleneck_dim: int = 64,
        head_bn: bool = True,
        local_crops: int = 4,
        local_size: int = 5,
        global_scale: tuple[float, float] = (0.7, 1.0),
        local_scale: tuple[float, float] = (0.3, 0.6),
        max_rotation: float = 10.0,
        intensity: float = 0.4,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        knn_k: int = 20,
        data: str = "digits",
    ):
        params_at_least(
            ("width", width, 1),
            ("out_dim", out_dim, 2),
            ("hidden_dim", hidden_dim, 1),
            ("bottleneck_dim", bottleneck_dim, 1),
            ("local_crops", local_crops, 0),
            ("local_size", local_size, 2),
            ("knn_k", knn_k, 1),
        )
        for key, scale in (("global_scale", global_scale), ("local_scale", local_scale)):
            if len(scale) != 2 or not 0.0 < scale[0] <= scale[1] <= 1.0:
                raise ConfigError(
                    f"task.params.{key}", f"must be [low, high] with 0 < low <= high <= 1; got {list(scale)}"
                )
        if student_temp <= 0:
            raise ConfigError("task.params.student_temp", f"must be > 0; got {student_temp}")
        if not 0.0 <= center_momentum < 1.0:
            raise ConfigError("task.params.center_momentum", f"must be in [0, 1); got {center_momentum}")
        if not 0.0 <= intensity < 1.0:
            raise ConfigError("task.params.intensity", f"must be in [0, 1); got {intensity}")
        self.width, self.out_dim, self.hidden_dim, self.bottleneck_dim = width, out_dim, hidden_dim, bottleneck_dim
        self.head_bn = head_bn
        self.local_crops, self.local_size = local_crops, local_size
        self.global_scale, self.local_scale = tuple(global_scale), tuple(local_scale)
        self.max_rotation, self.intensity = max_rotation, intensity
        self.student_temp, self.center_momentum, self.knn_k = student_temp, center_momentum, knn_k
        self.bank_path: str | None = None  # set by splits() on the driver: a local path or a URI
        self._bank: tuple[torch.Tensor, torch.Tensor] | None = None  # the training split, per worker
        self._initial_backbone: nn.Module | None = None  # the k-NN baseline, per worker

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        """The digits splits; the k-NN bank is the train split, read on every worker from where
        the split names it (``data.dir``: a local path or the store)."""
        splits = super().splits(data_dir)
        self.bank_path = splits["train"].path
        return splits

    def build_model(self) -> nn.Module:
        model = DinoModel(self.width, self.out_dim, self.hidden_dim, self.bottleneck_dim, self.head_bn)
        self._initial_backbone = copy.deepcopy(model.backbone).eval().requires_grad_(False)
        return model

    def views(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The 2 global views (2N, 1, 8, 8), then the local crops (K*N, 1, s, s) when K > 0."""
        rot, strength = self.max_rotation, self.intensity
        both = torch.cat([x, x])
        views = [random_resized_crops(both, x.shape[-1], self.global_scale, max_rotation=rot)]
        if self.local_crops:
            many = x.repeat(self.local_crops, 1, 1, 1)
            views.append(random_resized_crops(many, self.local_size, self.local_scale, max_rotation=rot))
        return [jitter_intensity(v, strength) for v in views]

    def batch_views(self, batch) -> tuple[list[torch.Tensor], int]:
        """A training batch's views (:meth:`views`) and its number of images."""
        x, _ = batch
        return self.views(x), len(x)

    def criterion(self, model: nn.Module, batch, ctx: StepContext) -> LossOutput:
        if ctx.ema is None:
            raise ValueError("task 'dino' needs the teacher: set ema.enabled=true")
        if TEACHER_TEMP not in ctx.values:
            raise ValueError(
                f"task 'dino' reads the teacher temperature from schedules.{TEACHER_TEMP}, which the config lacks; "
                f"add e.g. schedules.{TEACHER_TEMP}: {{value: 0.04, warmup_start: 0.02, warmup_steps: 200}}"
            )
        views, n = self.batch_views(batch)
        student_out = model(*views)
        teacher = ctx.ema.train()  # batch statistics in its BatchNorm layers, as DINO's teacher
        with torch.no_grad():
            teacher_features = teacher.backbone(views[0])
            teacher_out = teacher.head(teacher_features)
        center = unwrap(model).center
        loss, targets = dino_loss(
            student_out, teacher_out, center, 2 + self.local_crops, self.student_temp, ctx.values[TEACHER_TEMP]
        )
        entropy = -(targets * targets.clamp_min(1e-12).log()).sum(-1).mean()
        logs = {
            "teacher_entropy": entropy,
            # Every target is paired with the same number of student views, so the cross-entropy
            # splits into the targets' entropy and KL(teacher || student).
            "kl": loss.detach() - entropy,
            "feature_std": feature_std(teacher_features),
            TEACHER_TEMP: ctx.values[TEACHER_TEMP],
        }
        return LossOutput(loss, sample_size=n, logs=logs, stats={"center": center_stats(teacher_out)})

    def after_step(self, model: nn.Module, stats: dict[str, torch.Tensor]) -> None:
        update_center(unwrap(model).center, stats["center"], self.center_momentum)

    def evaluate(self, model: nn.Module, batch, metrics=None) -> EvalOutput:
        if self._initial_backbone is None or self.bank_path is None:
            raise RuntimeError("DinoTask.evaluate needs splits() and build_model() to have run")
        x, y = batch
        bank_x, bank_y = self.bank(x.device)
        features = model.features(x)
        n = float(len(y))
        initial = self._initial_backbone.to(x.device)
        return {
            "knn_accuracy": (knn_accuracy(model.features(bank_x), bank_y, features, y, self.knn_k), n),
            "knn_accuracy_init": (knn_accuracy(initial(bank_x), bank_y, initial(x), y, self.knn_k), n),
            "feature_std": (feature_std(features), n),
        }

    def bank(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The training split's images and labels, read once per worker."""
        if self._bank is None:
            self._bank = self.read(self.bank_path)
        return self._bank[0].to(device), self._bank[1].to(device)

    def read(self, path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole split, as the criterion and evaluation take it."""
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=COLUMNS)
        images = table.column("image").combine_chunks().to_numpy_ndarray()
        return self.collate({"image": images, "label": table.column("label").to_numpy()})


class DinoFolderTask(DinoTask):
    """DINO on a converted ImageFolder (``data=imagefolder``, the set at ``source``), labels used
    by the k-NN evaluation only: each training image's multi-crop views made in ``preprocess``
    from its row's seed (:func:`~raytrain_loops.data.formats.images.multi_crop`: 2 global views
    of ``size``, ``local_crops`` of ``local_size``, colour jitter, blur, solarisation); the
    evaluation and the k-NN bank (the train split, read on every worker) resized and centre
    cropped to ``size``; the backbone's input channels those of the data."""

    def __init__(self, source: str = "", size: int = 32, data: str = "imagefolder", **params: Any):
        digits_only = sorted({"max_rotation", "intensity"} & set(params))
        if digits_only:
            raise ConfigError(f"task.params.{digits_only[0]}", "is the digits' view; images get DINO's colour jitter, blur and solarisation")
        params_at_least(("size", size, 8))
        super().__init__(**params)
        self.images = image_views.ConvertedSet(source, "imagefolder")
        self.size = size

    def prepare(self, data_dir: Path) -> None:
        self.images.meta  # noqa: B018  (read and checked on the driver, carried to the workers)

    def splits(self, data_dir: Path) -> dict[str, ParquetSplit]:
        found = {name: self.images.split(name) for name in ("train", "eval")}
        self.bank_path = found["train"]
        return {name: ParquetSplit(path, COLUMNS) for name, path in found.items() if path}

    def data_digest(self) -> str:
        return self.images.digest

    def build_model(self) -> nn.Module:
        channels = self.images.channels
        model = DinoModel(self.width, self.out_dim, self.hidden_dim, self.bottleneck_dim, self.head_bn, channels)
        self._initial_backbone = copy.deepcopy(model.backbone).eval().requires_grad_(False)
        return model

    def preprocess(self, batch: dict[str, np.ndarray], train: bool) -> dict[str, np.ndarray]:
        decoded = [image_views.decode(raw, self.images.channels) for raw in batch["image"]]
        if not train:
            return {"image": np.stack([image_views.chw(image_views.center_crop(i, self.size)) for i in decoded]),
                    "label": np.asarray(batch["label"])}  # fmt: skip
        crops = [
            image_views.multi_crop(image, np.random.default_rng(int(seed)), self.size, self.local_size,
                                   self.local_crops, self.global_scale, self.local_scale)
            for image, seed in zip(decoded, batch[ROW_SEED], strict=True)
        ]  # fmt: skip
        return {"global": np.stack([g for g, _ in crops]), "local": np.stack([lo for _, lo in crops]),
                "label": np.asarray(batch["label"])}  # fmt: skip

    def collate(self, batch: dict[str, np.ndarray]):
        """Training: ``(views, labels)``, the views view-major as :meth:`DinoTask.views` orders
        them; evaluation: ``(images, labels)``. Pixels scaled to [0, 1]."""
        labels = torch.as_tensor(np.asarray(batch["label"]), dtype=torch.long)
        if "global" not in batch:
            return torch.from_numpy(np.ascontiguousarray(batch["image"])).float().div_(255.0), labels
        views = [torch.from_numpy(np.ascontiguousarray(batch[k])).float().div_(255.0) for k in ("global", "local")]
        return [torch.cat(v.unbind(1)) for v in views if v.shape[1]], labels

    def batch_views(self, batch) -> tuple[list[torch.Tensor], int]:
        views, labels = batch
        return views, len(labels)

    def read(self, path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=COLUMNS)
        rows = {"image": np.asarray(table.column("image").to_pylist(), dtype=object), "label": table.column("label").to_numpy()}
        return self.collate(self.preprocess(rows, train=False))
