"""`keras_sync.strategy.multi_worker.canonical`: one reading of device names for strategy.devices and local_devices."""

from __future__ import annotations

import pytest

from keras_sync.errors import StrategyError
from keras_sync.strategy.multi_worker import canonical


@pytest.mark.parametrize(
    "name",
    [
        "CPU:1",
        "cpu:1",
        "/cpu:1",
        "/device:CPU:1",
        " CPU:1 ",
        "/job:localhost/replica:0/task:0/device:CPU:1",
        "/job:worker/replica:0/task:3/device:CPU:1",
    ],
)
def test_every_spelling_of_one_device_reads_the_same(name):
    assert canonical(name, where="strategy.devices") == "CPU:1"


def test_gpu_names_keep_their_type():
    assert canonical("/gpu:0", where="strategy.devices") == "GPU:0"
    assert canonical("GPU:3", where="strategy.devices") == "GPU:3"


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "banana",
            "Invalid device name in strategy.devices. Received: 'banana'. Expected names such as \"CPU:0\" "
            'or "/device:GPU:1".',
        ),
        (
            "/job:worker",
            "Invalid device name in strategy.devices. Received: '/job:worker'. Expected a type and an "
            'index, such as "CPU:0" or "GPU:1".',
        ),
    ],
)
def test_a_bad_name_is_refused_naming_the_key_and_the_value(name, expected):
    with pytest.raises(StrategyError) as e:
        canonical(name, where="strategy.devices")
    assert str(e.value) == expected
