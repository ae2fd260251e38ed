"""Which keys of the unsplit model a pipeline stage holds: the declaration stages make.

A stage's ``state_dict`` names its tensors as the stage sees them (a stage holding decoder
layers 4 and 5 calls them ``layers.0`` and ``layers.1``); the unsplit model calls them
``layers.4`` and ``layers.5``. A stage declares the correspondence as a prefix map::

    from graphpipe.keymap import set_unsplit_keys

    set_unsplit_keys(stage, {"layers.0": "layers.4", "layers.1": "layers.5"})

A stage key is renamed by the longest prefix of the map that it starts with (a prefix
matches whole dotted components: ``layers.1`` matches ``layers.1.attn.qkv.weight``, not
``layers.10.attn.qkv.weight``); the empty prefix ``""`` matches every key (``{"": "model"}``
puts every key under ``model.``), and a key no prefix matches keeps its name. A stage without
a declaration keeps every key. ``graphpipe.checkpoint.save_checkpoint`` records each stage's
map in the checkpoint's marker and ``graphpipe.checkpoint.export_state_dict`` applies it.

This module imports nothing but torch's ``nn``, so that models can declare their maps
without importing ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

__all__ = ["set_unsplit_keys", "unsplit_keys", "unsplit_name"]

_ATTR = "_graphpipe_unsplit_keys"
_DOTTED = re.compile(r"[^.]+(\.[^.]+)*")  # "a.b.c": no empty component


def _check_prefix(what: str, value: object) -> str:
    if not isinstance(value, str) or (value and not _DOTTED.fullmatch(value)):
        raise ValueError(
            f"set_unsplit_keys: {what} must be '' or dotted names without empty parts "
            f"('layers.0'), got {value!r}"
        )
    return value


def unsplit_name(key: str, prefixes: Mapping[str, str] | None) -> str:
    """The unsplit model's name of the stage key ``key`` under the prefix map ``prefixes``
    (None: no declaration, the name is ``key``)."""
    if not prefixes:
        return key
    best = None
    for prefix in prefixes:
        if (prefix == "" or key == prefix or key.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    if best is None:
        return key
    rest = key[len(best) :] if best else "." + key  # "" or ".tail"
    target = prefixes[best]
    return target + rest if target else rest[1:]


def set_unsplit_keys(stage: nn.Module, prefixes: Mapping[str, str]) -> nn.Module:
    """Declare which keys of the unsplit model ``stage`` holds: ``{stage prefix: unsplit
    prefix}`` (see the module docstring); ``{}`` declares every key unchanged. Returns
    ``stage``.

    Raises ``ValueError`` naming the entry when a prefix is not a dotted name, matches no key
    of ``stage.state_dict()``, maps a key to the empty name, or when two of the stage's
    different tensors would get the same unsplit name.
    """
    if not isinstance(stage, nn.Module):
        raise TypeError(f"set_unsplit_keys takes an nn.Module, got {type(stage).__name__}")
    if not isinstance(prefixes, Mapping):
        raise ValueError(
            f"set_unsplit_keys: prefixes must map stage prefixes to unsplit prefixes, "
            f"got {prefixes!r}"
        )
    declared = {
        _check_prefix("a stage prefix", p): _check_prefix(f"the unsplit prefix of {p!r}", q)
        for p, q in prefixes.items()
    }
    tensors = stage.state_dict(keep_vars=True)
    for prefix in declared:
        if not any(prefix == "" or k == prefix or k.startswith(prefix + ".") for k in tensors):
            raise ValueError(
                f"set_unsplit_keys: the stage prefix {prefix!r} matches no key of the stage "
                f"({type(stage).__name__}, {len(tensors)} keys)"
            )
    owner: dict[str, str] = {}
    for key, tensor in tensors.items():
        name = unsplit_name(key, declared)
        if not name:
            raise ValueError(f"set_unsplit_keys: the stage key {key!r} maps to the empty name")
        other = owner.setdefault(name, key)
        if other != key and tensors[other] is not tensor:
            raise ValueError(
                f"set_unsplit_keys: the stage keys {other!r} and {key!r} both map to the "
                f"unsplit key {name!r} but are different tensors"
            )
    object.__setattr__(stage, _ATTR, declared)
    return stage


def unsplit_keys(stage: nn.Module) -> dict[str, str] | None:
    """The prefix map ``stage`` declared with ``set_unsplit_keys`` (a copy), or None."""
    declared = getattr(stage, _ATTR, None)
    return dict(declared) if declared is not None else None
