"""One rule for devices: store them indexed, compare them with ``same_device``.

``torch.device("cuda") != torch.device("cuda", 0)``, while every tensor made on a GPU reports its
index (``cuda:0``). So a device kept as a bare ``"cuda"`` refuses every tensor made on it.
``indexed_device`` gives the device every layer stores (the context, the model adapters, the
engine): ``cuda`` becomes ``cuda:{torch.cuda.current_device()}``; ``same_device`` is the one
comparison the launchers, the context's edge checks and the adapters make. Nothing here
imports the context: every layer above may import it.
"""

from __future__ import annotations

from typing import Union

import torch

DeviceLike = Union[torch.device, str, int]


def parse_device(device: DeviceLike, name: str = "device") -> torch.device:
    """``torch.device(device)``, or ``ValueError`` naming the argument ``name`` and the value
    (torch's own error says neither: ``"nope"``, or an int index with no accelerator)."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"{name}={device!r} must be a torch.device, a str or an int")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{name}={device!r} is not a torch device: {error}") from None


def indexed_device(device: DeviceLike) -> torch.device:
    """``device`` with its index: a CUDA device without one takes the current device's
    (``"cuda"`` -> ``cuda:0`` when device 0 is current); a CPU is ``cpu`` (it has one)."""
    device = parse_device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and device.index is not None:
        return torch.device("cpu")
    return device


def same_device(a: DeviceLike, b: DeviceLike) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` and ``cuda:N`` do when ``N`` is the
    current device). Equal ``torch.device`` objects answer at once (the common case)."""
    if a == b:
        return True
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and indexed_device(a) == indexed_device(b)
