"""Action costs: what the simulator (and ``Pipeline(costs=...)``) expects each action to take.

``Costs`` is plain data (numpy is imported only by ``durations``, which the simulator calls),
so that a command-line parser can show and parse it without importing the simulator.

Owns: nothing (a value type). May touch: nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

from graphpipe.schedule.ir import Action, Op

if TYPE_CHECKING:
    import numpy as np

    from graphpipe.schedule.packed import Cells

__all__ = ["Costs"]


@dataclass(frozen=True, slots=True)
class Costs:
    """Execution times of one action, in any unit (the simulator's times use the same).

    F: forward of one micro-batch through one stage.
    B: full backward (input and weight gradients).
    I: backward for input gradients only.
    W: the deferred weight-gradient work of one I.
    FB: an overlapped (F, B) pair; None means F + B (no gain from overlapping).
    p2p: latency of each message, from the moment both of its ends are posted.
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the op's name
    W: float = 1.0
    FB: float | None = None
    p2p: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value >= 0:
                raise ValueError(f"cost {f.name} must be >= 0, got {value}")

    @property
    def overlap(self) -> float:
        """The cost of an overlapped (F, B) pair."""
        return self.F + self.B if self.FB is None else self.FB

    def of(self, action: Action | None) -> float:
        """The cost of one compute cell (None, the final flush: 0)."""
        if action is None:
            return 0.0
        if action.op is Op.OVERLAP_F_B:
            forward, backward = action.parts()
            if backward.op is Op.B:
                return self.overlap
            return self.of(forward) + self.of(backward)
        return {Op.F: self.F, Op.B: self.B, Op.I: self.I, Op.W: self.W}[action.op]

    def durations(self, cells: Cells) -> np.ndarray:
        """``of`` for every cell of ``packed.Cells`` (a flush: 0)."""
        import numpy as np

        from graphpipe.schedule import packed

        first_op, second_op = packed.op_of(cells.first), packed.op_of(cells.second)
        table = np.asarray([self.F, self.B, self.I, self.W], dtype=np.float64)
        plain = table[np.minimum(first_op, 3)]
        pair = np.where(second_op == packed.B, self.overlap, self.F + self.I)
        out = np.where(cells.second >= 0, pair, plain)
        return np.where(cells.first >= 0, out, 0.0)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse ``"F=1,B=2,W=1,p2p=0.1"`` (``F&B`` is accepted for ``FB``); unnamed costs keep
        their defaults."""
        names = {f.name: f.name for f in fields(cls)} | {"F&B": "FB"}
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = (s.strip() for s in item.partition("="))
            if not sep or key not in names:
                raise ValueError(
                    f"bad cost {item!r}: expected NAME=NUMBER with NAME one of "
                    f"{', '.join(n for n in names if n != 'F&B')}"
                )
            try:
                values[names[key]] = float(value)
            except ValueError:
                raise ValueError(f"bad cost {item!r}: {value!r} is not a number") from None
        return cls(**values)

    def __str__(self) -> str:
        return " ".join(f"{k}={v:g}" for k, v in asdict(self).items() if v is not None)
