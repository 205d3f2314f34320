"""What `strategy.kind: auto` picks, and why: pure detection, no TensorFlow."""

from __future__ import annotations

import json

import pytest

from keras_sync.config import load_config
from keras_sync.errors import ClusterError
from keras_sync.strategy import BUILDERS, detect

TWO_WORKERS = json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}})


def test_every_kind_has_a_builder():
    assert set(BUILDERS) == {"default", "one_device", "mirrored", "multi_worker_mirrored", "tpu"}


@pytest.mark.parametrize("config, env, gpus, kind, reason", [
    ({}, {}, 0, "default", "auto: one worker, no GPU, no simulated replicas"),
    ({}, {}, 1, "default", "auto: one worker, one GPU, no simulated replicas"),
    ({}, {}, 4, "mirrored", "auto: 4 GPUs"),
    ({"strategy": {"simulated_cpu_replicas": 2}}, {}, 0, "mirrored", "auto: strategy.simulated_cpu_replicas=2"),
    ({}, {"TF_CONFIG": TWO_WORKERS}, 0, "multi_worker_mirrored", "auto: TF_CONFIG (plain) names 2 workers"),
    ({}, {"TPU_NAME": "t1"}, 8, "tpu", "auto: $TPU_NAME is set"),
    ({"strategy": {"kind": "mirrored"}}, {"TF_CONFIG": TWO_WORKERS}, 0, "mirrored", "strategy.kind is 'mirrored' (dict)"),
])
def test_auto_detection(config, env, gpus, kind, reason):
    d = detect(load_config(config, environ={}), env, gpus=gpus)
    assert (d.kind, d.reason) == (kind, reason)


def test_one_task_tf_config_is_not_multi_worker():
    one = json.dumps({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}})
    assert detect(load_config({}, environ={}), {"TF_CONFIG": one}, gpus=0).kind == "default"


def test_bad_tf_config_is_a_cluster_error():
    with pytest.raises(ClusterError, match="TF_CONFIG"):
        detect(load_config({}, environ={}), {"TF_CONFIG": "{not json"}, gpus=0)
