"""A module's weights from a user's file (``task.params.backbone_weights``): a ``state_dict`` in
safetensors, or in a ``.pt``/``.pth`` file read with ``torch.load(..., weights_only=True)`` (no
code is unpickled), a local path or a URI. A ``raytrain-loops export`` file (``state.pt``) is read
as its ``model``: a DINO run's exported teacher (``export --ema``) gives a classifier its backbone,
DINO's own fine-tuning workflow.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import torch
from torch import nn

from raytrain_loops import storage
from raytrain_loops.errors import WeightsError

PREFIXES = ("backbone.", "features.")
"""Where a backbone's keys may stand in a whole model's ``state_dict`` (DINO's model, a classifier)."""


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` by name (see the module docstring)."""
    data = storage.read_bytes(path if storage.is_uri(path) else storage.local_path(path))
    if data is None:
        raise WeightsError(f"{path} is not there")
    if path.split("?")[0].endswith(".safetensors"):
        from safetensors.torch import load

        return load(data)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # pickled code, or not a torch file
        raise WeightsError(f"{path} is no state_dict torch.load reads safely ({err})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):  # an exported state.pt
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path} holds no state_dict of tensors")
    return state


def load_backbone(
    module: nn.Module, path: str, prefixes: Sequence[str] = PREFIXES, say: Callable[[str], None] = print
) -> tuple[list[str], list[str]]:
    """Load the weights of ``path`` into ``module``: a key under one of ``prefixes`` counts as the
    module's own key without it. Says which keys of the module the file lacks (missing) and which
    of the file the module lacks (unexpected), and returns them; a tensor whose shape is not the
    module's is a :class:`WeightsError` naming the key."""
    own = module.state_dict()
    found = {}
    for key, value in read_state_dict(path).items():
        bare = next((key[len(p) :] for p in prefixes if key.startswith(p) and key[len(p) :] in own), key)
        found[bare] = value
    for key, tensor in own.items():  # the first in the module's order
        if key in found and found[key].shape != tensor.shape:
            raise WeightsError(
                f"{path}: {key} has shape {list(found[key].shape)}, the model's "
                f"{list(tensor.shape)} (a backbone of another width or depth?)"
            )
    result = module.load_state_dict({k: v for k, v in found.items() if k in own}, strict=False)
    missing, unexpected = list(result.missing_keys), sorted(k for k in found if k not in own)
    say(
        f"backbone_weights {path}: {len(found) - len(unexpected)} tensors loaded; "
        f"missing {missing or 'none'}; unexpected {unexpected or 'none'}"
    )
    return missing, unexpected
