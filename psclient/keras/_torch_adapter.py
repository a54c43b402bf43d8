"""The glue's PyTorch adapter (see ``psclient.keras._backend``).

Keras on PyTorch runs its steps eagerly, so host code (a push, a ring operation) is called directly
(``EagerAdapter``). What is PyTorch's own is ``psclient.keras.Embedding``'s lookup: the rows read from
the shards become a leaf tensor that requires grad, and a hook on it hands the rows' gradient to the
layer when the step's ``backward`` reaches it (before the optimizer's ``apply``, whose exchange pushes
them as rows); the layer's anchor gets a zero gradient, so that the optimizer applies it at all.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from psclient.keras._backend import EagerAdapter, RowKeeper, RowLookup


class Adapter(EagerAdapter):
    """PyTorch: eager steps, row gradients of ``psclient.keras.Embedding`` caught by a tensor hook."""

    name = "torch"
    host_row_gradients = True

    def lookup_rows(
        self, ids: Any, anchor: Any, lookup: RowLookup, keep: RowKeeper, width: int, dtype: str
    ) -> Any:
        if ids.device.type == "meta":  # Keras's compute_output_spec: shapes only, nothing to read
            return torch.empty((ids.shape[0], width), dtype=getattr(torch, dtype), device="meta") + anchor * 0
        flat = ids.detach().cpu().numpy().reshape(-1)
        rows = torch.as_tensor(np.asarray(lookup(flat)).reshape(len(flat), width), device=anchor.device)
        rows = rows.to(getattr(torch, dtype))
        if not (torch.is_grad_enabled() and anchor.requires_grad):  # inference (predict, evaluate)
            return rows
        rows.requires_grad_(True)

        def caught(grad: torch.Tensor) -> None:
            keep(flat, grad.detach().cpu().numpy())

        rows.register_hook(caught)
        return rows + anchor * 0  # the anchor's gradient: zeros


__all__ = ["Adapter"]
