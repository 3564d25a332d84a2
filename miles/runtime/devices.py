"""`--device` names as torch devices."""

from __future__ import annotations


def resolve_device(name: str):
    """`--device` as a torch device: auto means cuda when this process sees a GPU (a Ray actor
    sees the GPU its bundle gave it)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
