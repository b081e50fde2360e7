"""One training batch, the unit every loader hands to the model.

Legend: B sequences per batch, L tokens per sequence (``data.seq_len``). ``targets[b, t] ==
input_ids[b, t + 1]`` of the same window; ``doc_ids`` changes where a document starts (SSM state reset,
attention masked); ``loss_mask`` is False for untrained targets (chat prompts, padding, seams).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    targets: torch.Tensor  # [B, L] int64
    doc_ids: torch.Tensor  # [B, L] int32
    loss_mask: torch.Tensor  # [B, L] bool

    @classmethod
    def from_windows(cls, windows: np.ndarray, eos_id: int) -> Batch:
        """Pretraining windows of L + 1 tokens: every target is trained on; a doc starts at each eos."""
        windows_BL1 = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
        input_ids = windows_BL1[:, :-1]
        doc_ids = torch.cumsum(input_ids == eos_id, dim=1, dtype=torch.int32)
        return cls(
            input_ids=input_ids.contiguous(),
            targets=windows_BL1[:, 1:].contiguous(),
            doc_ids=doc_ids,
            loss_mask=torch.ones_like(input_ids, dtype=torch.bool),
        )

    @property
    def num_tokens(self) -> int:
        """Trained target tokens in the batch."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            *(
                t.to(device, non_blocking=non_blocking)
                for t in (self.input_ids, self.targets, self.doc_ids, self.loss_mask)
            )
        )
