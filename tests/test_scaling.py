"""Pure scaling maths: batch sizes, learning-rate rules (Goyal et al. 2017), gradual warmup."""

from __future__ import annotations

import doctest
import math

import pytest

import keras_sync
from keras_sync.errors import ScalingError
from keras_sync.training import scaling


def test_doctests_hold():
    result = doctest.testmod(scaling)
    assert result.attempted >= 10 and result.failed == 0


def test_goyal_example_base_256_to_8192():
    assert (
        keras_sync.scale_learning_rate(
            0.1, global_batch_size=8192, base_batch_size=256, rule="linear"
        )
        == 3.2
    )


@pytest.mark.parametrize(
    "rule, expected", [("linear", 0.4), ("sqrt", 0.2), ("none", 0.1), ("SQRT", 0.2)]
)
def test_rules(rule, expected):
    assert scaling.scale_learning_rate(
        0.1, global_batch_size=1024, base_batch_size=256, rule=rule
    ) == pytest.approx(expected)


def test_every_rule_a_config_accepts_is_applied():
    # The names live in keras_sync.config (what a user may write), the maths here: a name added there
    # without its maths fails now, not at a user's first run.
    from keras_sync.config import LR_RULES

    got = {
        r: scaling.scale_learning_rate(0.1, global_batch_size=1024, base_batch_size=256, rule=r)
        for r in LR_RULES
    }
    assert got == pytest.approx({"linear": 0.4, "sqrt": 0.2, "none": 0.1})


def test_sqrt_of_non_square():
    got = scaling.scale_learning_rate(0.1, global_batch_size=96, base_batch_size=32, rule="sqrt")
    assert got == pytest.approx(0.1 * math.sqrt(3))


def test_batch_sizes_both_ways():
    assert scaling.resolve_batch_sizes(32, None, 3) == (32, 96)
    assert scaling.resolve_batch_sizes(None, 96, 3) == (32, 96)


def test_global_not_divisible_names_key_and_fix():
    with pytest.raises(
        ScalingError,
        match=r"batch.global. Received: global=100 with 3 replicas. Expected a "
        r"multiple of 3 .* use 99 or 102",
    ):
        scaling.per_replica_batch_size(100, 3)
    with pytest.raises(ScalingError, match="use 4"):
        scaling.per_replica_batch_size(2, 4)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            dict(base_lr=0, global_batch_size=8, base_batch_size=8, rule="linear"),
            "Received: base_lr=0",
        ),
        (
            dict(base_lr=float("nan"), global_batch_size=8, base_batch_size=8, rule="linear"),
            "base_lr=nan",
        ),
        (
            dict(base_lr=0.1, global_batch_size=0, base_batch_size=8, rule="linear"),
            "global_batch_size=0",
        ),
        (
            dict(base_lr=0.1, global_batch_size=8, base_batch_size=8, rule="cubic"),
            "rule='cubic'. Expected one of linear, sqrt, none",
        ),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ScalingError, match=pattern):
        scaling.scale_learning_rate(kwargs.pop("base_lr"), **kwargs)


def test_warmup_equal_increments_then_peak():
    lrs = [
        scaling.warmup_learning_rate(s, start_lr=0.1, peak_lr=3.2, warmup_steps=5) for s in range(8)
    ]
    steps = [b - a for a, b in zip(lrs, lrs[1:6])]
    assert lrs[0] == 0.1 and lrs[5:] == [3.2, 3.2, 3.2]
    assert all(d == pytest.approx((3.2 - 0.1) / 5) for d in steps)


def test_warmup_steps_from_epochs():
    assert scaling.warmup_steps_from(warmup_epochs=0.5, steps_per_epoch=7) == 4
    with pytest.raises(ScalingError, match="needs the number of steps per epoch"):
        scaling.warmup_steps_from(warmup_epochs=1)
    with pytest.raises(ScalingError, match="Expected one of them"):
        scaling.warmup_steps_from(warmup_epochs=1, warmup_steps=2, steps_per_epoch=3)


def test_a_warmup_of_no_steps_is_a_keras_sync_error_naming_the_value() -> None:
    from keras_sync.errors import UsageError
    from keras_sync.training.schedules import GradualWarmup

    with pytest.raises(UsageError, match=r"Received: warmup_steps=0\. Expected an integer >= 1"):
        GradualWarmup(0.1, 0.4, warmup_steps=0)
