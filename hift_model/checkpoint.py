"""Reading an upstream ``hift.pt`` and loading it strictly.

Accepted layouts (all load into the same tensors):

* upstream: ``X.parametrizations.weight.original0`` (g) / ``original1`` (v), the released ``hift.pt``;
* legacy weight norm: ``X.weight_g`` / ``X.weight_v``;
* either of them with a ``generator.`` prefix on every key (files saved from the training wrapper).

Anything else fails before any folding, with a :class:`CheckpointError` that names the offending keys.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .layers import WeightNormAPI

F0_PREFIX = "f0_predictor."
WRAPPER_PREFIX = "generator."
_MODERN_G, _MODERN_V = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
_LEGACY_G, _LEGACY_V = ".weight_g", ".weight_v"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded strictly; the message names the problem and the fix."""


def _preview(keys: Any, limit: int = 6) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _check_container(name: str) -> None:
    """A PyTorch checkpoint is a zip archive (torch.save) or, from old versions, a pickle (protocol >= 2 starts
    with 0x80); anything else (a text file, an ONNX model) is refused before torch.load sees it."""
    with open(name, "rb") as fh:
        head = fh.read(4)
    if head == b"PK\x03\x04" or head[:1] == b"\x80":  # a zip's first local header, or a pickle's PROTO opcode
        return
    raise CheckpointError(f"{name!r} is not a PyTorch checkpoint (neither a torch.save zip archive nor a pickle); "
                          f"pass the vocoder's hift.pt")


def read_checkpoint(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Load a state dict with ``torch.load(weights_only=True)`` (never executes pickled code) and check its type."""
    if isinstance(source, Mapping):
        obj: Any = source
        name = "the given state dict"
    elif not isinstance(source, (str, os.PathLike)):
        obj, name = source, "the given object"
    else:
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise CheckpointError(f"checkpoint {name!r} does not exist or is not a file")
        _check_container(name)
        try:
            obj = torch.load(name, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            # torch's message advises turning the safe loader off; we never pass that on. Name the culprit only.
            culprit = next((line.strip() for line in str(exc).splitlines() if "Unsupported global" in line), "")
            raise CheckpointError(
                f"checkpoint {name!r} holds pickled objects other than tensors{f' ({culprit})' if culprit else ''}, "
                f"which the safe loader refuses; re-save the weights alone with torch.save(model.state_dict())"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - torch.load raises many types on damaged files (IndexError too)
            raise CheckpointError(
                f"checkpoint {name!r} is not a readable PyTorch file (truncated or damaged?): "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{name} holds a {type(obj).__name__}, not a state dict of tensors (upstream hift.pt)")
    if not obj:
        raise CheckpointError(f"{name} is an empty dict; expected the 328 tensors of an upstream hift.pt")
    bad = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"{name} is not a flat state dict of tensors: entries {_preview(map(str, bad))} are not tensors. "
            f"If it wraps the weights (e.g. under 'state_dict' or 'generator'), save that inner dict instead.")
    return dict(obj)


def normalize_keys(state_dict: Mapping[str, torch.Tensor], api: WeightNormAPI) -> dict[str, torch.Tensor]:
    """Strip a ``generator.`` prefix and spell weight-norm keys the way modules built with ``api`` expect."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith(WRAPPER_PREFIX):
            key = key[len(WRAPPER_PREFIX):]
        if api == "legacy":
            key = key.replace(_MODERN_G, _LEGACY_G).replace(_MODERN_V, _LEGACY_V)
        else:
            if key.endswith(_LEGACY_G):
                key = key[: -len(_LEGACY_G)] + _MODERN_G
            elif key.endswith(_LEGACY_V):
                key = key[: -len(_LEGACY_V)] + _MODERN_V
        if key in out:
            raise CheckpointError(f"checkpoint has key {key!r} twice once prefixes/spellings are normalised")
        out[key] = value
    return out


def split_f0(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split an upstream-layout state dict into (generator keys, F0 predictor keys without their prefix)."""
    generator = {k: v for k, v in state_dict.items() if not k.startswith(F0_PREFIX)}
    f0 = {k[len(F0_PREFIX):]: v for k, v in state_dict.items() if k.startswith(F0_PREFIX)}
    return generator, f0


def _looks_folded(missing: set[str], unexpected: set[str]) -> bool:
    """Every missing weight-norm pair has a plain ``.weight`` among the unexpected keys."""
    stems = {k[: -len(_MODERN_V)] for k in missing if k.endswith(_MODERN_V)}
    stems |= {k[: -len(_LEGACY_V)] for k in missing if k.endswith(_LEGACY_V)}
    return bool(stems) and all(s + ".weight" in unexpected for s in stems)


def load_strict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], what: str) -> None:
    """``load_state_dict(strict=True)`` after our own key and shape check, so errors say what was expected."""
    from .folding import count_weight_norms  # local: folding imports nothing from here, keep the graph acyclic

    expected = module.state_dict()
    if count_weight_norms(module) == 0 and any(k.endswith((_MODERN_V, _LEGACY_V)) for k in state_dict):
        raise CheckpointError(
            f"the {what} instance is already folded (its weight norms were removed), so an original checkpoint "
            f"cannot load into it; load into a fresh instance (hift_export.load_hift builds one) and fold after")
    missing = set(expected) - set(state_dict)
    unexpected = set(state_dict) - set(expected)
    if missing or unexpected:
        if _looks_folded(missing, unexpected):
            raise CheckpointError(
                f"the {what} checkpoint is already folded: it has plain '.weight' tensors where an upstream hift.pt "
                f"has weight-norm g/v pairs (e.g. {_preview(unexpected, 3)}). Export from the original hift.pt.")
        raise CheckpointError(
            f"{what} checkpoint does not match the CosyVoice3 layout: "
            f"{len(missing)} missing keys [{_preview(missing)}], {len(unexpected)} unexpected keys "
            f"[{_preview(unexpected)}]; expected the {len(expected)} keys of upstream's Fun-CosyVoice3 hift.pt (e.g. "
            f"{_preview(set(expected), 3)})")
    wrong = {k: (tuple(state_dict[k].shape), tuple(v.shape)) for k, v in expected.items()
             if tuple(state_dict[k].shape) != tuple(v.shape)}
    if wrong:
        detail = "; ".join(f"{k}: got {g}, expected {e}" for k, (g, e) in sorted(wrong.items())[:4])
        hint = ""
        if any(k.startswith("ups.") for k in wrong) or "conv_pre" in " ".join(wrong):
            hint = (" This looks like a CosyVoice2 HiFTGenerator checkpoint (ConvTranspose1d upsampling, centred "
                    "conv_pre); this toolchain exports the CosyVoice3 CausalHiFTGenerator.")
        raise CheckpointError(f"{what} checkpoint has {len(wrong)} tensors of the wrong shape: {detail}.{hint}")
    non_float = [k for k, v in state_dict.items() if not v.is_floating_point()]
    if non_float:
        raise CheckpointError(f"{what} checkpoint tensors {_preview(non_float)} are not floating point")
    module.load_state_dict(dict(state_dict), strict=True)
