"""Learning-rate schedules for policy updates: constant or cosine, with linear warmup.

Stateless apart from the update counter the trainer keeps (and checkpoints): the learning rate of
update ``n`` (0-based) is ``base_lr * factor(n)``. The trainer sets it right before each policy
optimizer step, so code that changes the optimizer's lr for another phase (an SFT warm start)
does not derail the schedule.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None  # cosine: updates until min_lr_ratio is reached
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; choose one of {SCHEDULES}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"a cosine schedule needs total_steps > warmup_steps (got total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps}); set trainer.total_steps"
            )

    def factor(self, update: int) -> float:
        """Multiplier of the base lr for the ``update``-th optimizer step (0-based)."""
        if update < self.warmup_steps:
            return (update + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        assert self.total_steps is not None
        progress = min(1.0, (update - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        cos = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cos

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
