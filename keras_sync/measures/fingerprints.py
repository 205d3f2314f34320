"""Pure logic of `WeightDivergence`: compare the replicas' fingerprints of each mirrored variable
(a 32-bit checksum of its bits as two exact 16-bit halves, then the mean and the RMS)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CHECK_HI, CHECK_LO, MEAN, RMS = range(4)


@dataclass(frozen=True)
class Divergence:
    """``value``: 0.0 when all checksums agree, else the largest spread of a diverged mean or RMS."""

    value: float
    diverged_variables: int
    variables: int


def summarize(gathered: Sequence[Sequence[Sequence[float]]]) -> Divergence:
    """The `Divergence` of gathered fingerprints, indexed ``[replica][variable][column]``.

    >>> summarize([[[1, 2, 0.5, 1.0], [0, 7, 0.1, 0.2]], [[1, 3, 0.25, 1.5], [0, 7, 0.1, 0.2]]])
    Divergence(value=0.5, diverged_variables=1, variables=2)
    """
    if not gathered:
        return Divergence(0.0, 0, 0)
    value, diverged = 0.0, 0
    for rows in zip(*gathered):  # one variable: its row on every replica
        if len({(row[CHECK_HI], row[CHECK_LO]) for row in rows}) > 1:  # else equal (or 2**-32)
            diverged += 1
            for col in (MEAN, RMS):
                value = max(value, max(row[col] for row in rows) - min(row[col] for row in rows))
    return Divergence(float(value), diverged, len(gathered[0]))
