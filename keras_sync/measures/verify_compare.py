"""The maths of `keras-sync verify`: do a distributed run and its one-device reference train alike,
and if not, why (the update's norm ``|w_t+1 - w_t|`` is compared, not the gradients' norms)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Unit roundoff of the formats a step may compute in (IEEE float32, float16; bfloat16).
EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
#: The quantities compared at every step, in the order a cause is looked for.
QUANTITIES = ("examples", "lr", "loss", "update")
Steps = Sequence[Mapping[str, float]]  # a recording's per-step values
Facts = Mapping[str, Any]  # what the recording knows of the model and the run


def tolerance(steps: int, precision: str = "float32") -> float:
    """The relative difference two correct runs may show after ``steps`` steps: ``64 eps (steps + 1)``.

    A sum reordered by the all-reduce differs by up to ~n eps (Higham 2002, sec. 4.2), carried over
    steps; 64 covers the sums inside a step.

    >>> f"{tolerance(20):.1e}", f"{tolerance(20, 'bfloat16'):.2f}"
    ('1.6e-04', '10.50')
    """
    return 64 * EPS[precision] * (steps + 1)


def precision_of(policy: str) -> str:
    """The compute format of a Keras dtype policy name."""
    return "bfloat16" if "bfloat16" in policy else "float16" if "float16" in policy else "float32"


def close(a: float, b: float, tol: float) -> bool:
    """Whether two values agree to ``tol``, relative to the larger (absolute below 1; NaN == NaN).

    >>> close(1.0, 1.0 + 1e-6, 1e-5), close(100.0, 101.0, 1e-3), close(float("nan"), 1.0, 1e-5)
    (True, False, False)
    """
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


@dataclass(frozen=True)
class Parting:
    """A step where the runs differ in one quantity."""

    step: int
    quantity: str
    subject: float
    reference: float


@dataclass(frozen=True)
class Verdict:
    """The comparison; ``layers``: (name, largest weight difference), largest first."""

    same: bool
    cause: str | None
    partings: list[Parting]
    layers: list[tuple[str, float]]
    tolerance: float
    steps: int

    @property
    def last_line(self) -> str:
        """``verify: same as one device (...)`` or ``verify: different from one device: <cause> (...)``."""
        largest = self.layers[0][1] if self.layers else 0.0
        how = "same as one device" if self.same else f"different from one device: {self.cause}"
        figures = f"largest weight difference {largest:.2g}, tolerance {self.tolerance:.1e}"
        return f"verify: {how} ({self.steps} steps, {figures})"


def likely_cause(
    first: Sequence[Parting], subject: Steps, reference: Steps, facts: Facts, n: int
) -> str:
    """The likely cause of a difference: the first ones, the model's ``facts``, ``n`` replicas."""
    first_of = {p.quantity: p for p in reversed(first)}
    if p := first_of.get("examples"):
        why = "data sharded twice, a dataset's own batch, or an uneven last batch"
        return f"examples per step differ: {p.subject:g} distributed, {p.reference:g} on one device at step {p.step} ({why})"
    if p := first_of.get("lr"):
        why = "a schedule or rate set outside keras-sync's scaling"
        return f"the learning rate applied differs: {p.subject:g} distributed, {p.reference:g} on one device at step {p.step} ({why})"
    causes = []
    # The first updates' norms differ by the replica count: a loss summed over the replicas.
    s, r = (subject[0]["update"], reference[0]["update"]) if subject and reference else (0, 0)
    why = "a loss reduction of sum, or a custom train_step, sums the replicas' gradients"
    if facts.get("custom_train_step"):
        rule = facts.get("train_step_gradients", "sum")
        why = f"the custom train_step's loss is not divided by the replica count and runtime.train_step_gradients is {rule}, so the replicas' gradients are summed"
    ratio = s / r if s > 0 and r > 0 else 0.0
    for size, factor in (("large", 1 / n), ("small", n)):
        if n > 1 and abs(ratio * factor - 1) < 0.05:
            causes.append(f"the gradient is {n} times too {size} ({why})")
    if facts.get("batch_norm") and not facts.get("sync_batch_norm"):
        causes.append(
            f"BatchNorm batch statistics: {facts['batch_norm']} BatchNormalization layer(s) normalise each replica's share of the batch, not the global batch (set runtime.sync_batch_norm: true)"
        )
    if facts.get("random_layers"):
        causes.append(
            f"random ops draw different numbers on each replica ({', '.join(facts['random_layers'])}: Dropout, random augmentation), so the runs are equal in distribution, not in value"
        )
    if facts.get("add_loss"):
        causes.append(
            f"an add_loss term that sums over the batch ({facts['add_loss']} term(s)): each replica's share is divided by the replica count again, so it counts 1/N of one device's"
        )
    if facts.get("precision", "float32") != "float32":
        causes.append(f"mixed-precision ops ({facts['precision']}) beyond their tolerance")
    if causes:
        others = "; ".join(c.split(":")[0].split(" (")[0] for c in causes[1:])
        return f"{causes[0]} (also possible: {others})" if others else causes[0]
    if first and first[0].step == 0 and first[0].quantity == "loss":
        why = "a data order or generator that verify could not make deterministic"
        return f"the first loss differs before any update, from the same weights: the batches differ ({why}) or a non-deterministic op"
    shown = ", ".join(f"{p.quantity} at step {p.step}" for p in first[:3]) or "the final weights"
    return f"no known cause fits; what differed: {shown}"


def verdict(
    subject: Steps,
    reference: Steps,
    layers: Mapping[str, tuple[float, float]],
    facts: Facts,
    n: int,
) -> Verdict:
    """Compare two recordings of ``n`` replicas; ``layers``: layer -> (largest |weight diff|, |weight|)."""
    steps = min(len(subject), len(reference))
    tol = tolerance(steps, facts.get("precision", "float32"))
    parts = [
        Parting(step, q, float(s[q]), float(r[q]))
        for step, (s, r) in enumerate(zip(subject[:steps], reference[:steps]))
        for q in QUANTITIES
        if not close(float(s[q]), float(r[q]), tol)
    ]
    if len(subject) != len(reference):
        parts.append(Parting(steps, "steps", float(len(subject)), float(len(reference))))
    ranked = sorted(((name, d) for name, (d, _) in layers.items()), key=lambda item: -item[1])
    same = not parts and all(d <= tol * max(1.0, w) for d, w in layers.values())
    first = [p for p in parts if p.step == parts[0].step] if parts else []
    cause = None if same else likely_cause(first, subject, reference, facts, n)
    return Verdict(same, cause, parts, ranked, tol, steps)
