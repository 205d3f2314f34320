"""The config loader: defaults, precedence, and one ConfigError per problem with file:line and key path."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from keras_sync.config import Config, load_config
from keras_sync.config.kinds import KINDS
from keras_sync.errors import ConfigError


def write(tmp_path: Path, text: str, name: str = "keras_sync.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def messages(exc: ConfigError) -> list[str]:
    return [str(i) for i in exc.issues]


def test_defaults_when_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KERAS_SYNC_CONFIG", raising=False)
    cfg = load_config(environ={})
    assert cfg == Config()
    assert (
        cfg.strategy.kind == "auto"
        and cfg.batch.per_replica == 32
        and cfg.learning_rate.scaling == "linear"
    )
    assert cfg.source == "<defaults>" and cfg.source_of("batch.per_replica") == "default"


def test_reads_keras_sync_yaml_in_cwd_then_env_var(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "batch: {per_replica: 8}\n")
    assert load_config(environ={}).batch.per_replica == 8
    other = write(tmp_path, "batch: {per_replica: 16}\n", "other.yaml")
    assert load_config(environ={"KERAS_SYNC_CONFIG": other}).batch.per_replica == 16


def test_full_file_round_trips(tmp_path):
    path = write(
        tmp_path,
        """
        strategy:
          kind: Multi-Worker-Mirrored
          communication: RING
          cluster: slurm
          connect_timeout_s: 10
          tpu: {name: my-tpu, zone: us-central1-b, project: p}
        batch: {global: 512, drop_remainder: true, shard_policy: off}
        learning_rate: {base: 0.1, base_batch_size: 256, scaling: sqrt, warmup_epochs: 2.5}
        mlflow: {enabled: false, experiment: e, run_name: r, log_every_n_steps: 50}
        fault_tolerance: {backup_dir: /tmp/b, save_freq: 100}
    """,
    )
    cfg = load_config(path, environ={})
    assert cfg.strategy.kind == "multi_worker_mirrored" and cfg.strategy.communication == "ring"
    assert cfg.batch.global_ == 512 and cfg.batch.per_replica is None
    assert cfg.batch.shard_policy == "off", (
        "YAML 1.1 reads off as false; it is a valid shard policy"
    )
    assert cfg.learning_rate.warmup_epochs == 2.5 and cfg.fault_tolerance.save_freq == 100
    assert cfg.to_dict()["batch"]["global"] == 512
    assert (
        cfg.source_of("strategy.kind") == "file" and cfg.source_of("strategy.devices") == "default"
    )
    assert load_config(cfg.to_dict(), environ={}) == cfg


def test_precedence_flag_over_env_over_file(tmp_path):
    path = write(tmp_path, "mlflow: {tracking_uri: sqlite:///file.db}\nbatch: {per_replica: 8}\n")
    cfg = load_config(path, environ={"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
    assert (
        cfg.mlflow.tracking_uri == "http://127.0.0.1:5000"
        and cfg.source_of("mlflow.tracking_uri") == "env"
    )
    cfg = load_config(
        path,
        environ={"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"},
        overrides={"mlflow.tracking_uri": "sqlite:///flag.db", "batch.per_replica": 4},
    )
    assert (
        cfg.mlflow.tracking_uri == "sqlite:///flag.db"
        and cfg.source_of("mlflow.tracking_uri") == "flag"
    )
    assert cfg.batch.per_replica == 4 and cfg.source_of("batch.per_replica") == "flag"


def test_unknown_key_names_line_and_suggests(tmp_path):
    path = write(tmp_path, "strategy:\n  kind: mirrored\n  devicez: []\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert messages(err.value) == [
        f"{path}:3: strategy.devicez: unknown key 'devicez'; did you mean 'devices'? (allowed: kind, devices, "
        "simulated_cpu_replicas, cross_device_ops, communication, cluster, connect_timeout_s, tpu, indexed_job, slurm)"
    ]
    assert err.value.line == 3 and err.value.key_path == "strategy.devicez"


def test_yaml_boolean_kind_gets_quote_hint(tmp_path):
    path = write(tmp_path, "strategy:\n  kind: off\n")
    with pytest.raises(
        ConfigError, match=r":2: strategy.kind: received false, expected one of .*quote the value"
    ):
        load_config(path, environ={})


def test_all_errors_reported_at_once_in_line_order(tmp_path):
    path = write(
        tmp_path,
        """\
        strategy: {kind: mirorred, simulated_cpu_replicas: -1}
        batch: {per_replica: 32, global: 64}
        learning_rate: {base: "fast", warmup_epochs: 1, warmup_steps: 3}
    """,
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    got = messages(err.value)
    assert got == [
        f"{path}:1: strategy.kind: received 'mirorred', expected one of {', '.join(KINDS)}; did you mean 'mirrored'?",
        f"{path}:1: strategy.simulated_cpu_replicas: received -1, expected an integer >= 0",
        f"{path}:2: batch.global: received batch.per_replica=32 and batch.global=64; give exactly one of them "
        "(set the other to null or remove it)",
        f"{path}:3: learning_rate.base: received 'fast', expected a number > 0",
        f"{path}:3: learning_rate.warmup_steps: received warmup_epochs=1 and warmup_steps=3; give one of them "
        "(set the other to 0)",
    ]


@pytest.mark.parametrize(
    "text, line, pattern",
    [
        ("", 1, "the file is empty"),
        ("- a\n- b\n", 1, "received a list at the top level, expected a mapping"),
        ("strategy: !!python/object/apply:os.system ['echo hi']\n", 1, "YAML tag not allowed"),
        ("strategy:\n  kind: [\n", 3, "YAML syntax error"),
        (
            "batch: {per_replica: 8}\nbatch: {per_replica: 9}\n",
            2,
            "duplicate key 'batch' \\(first at line 1\\)",
        ),
        (
            "strategy: mirrored\n",
            1,
            "strategy: received str 'mirrored' at the strategy, expected a mapping",
        ),
        (
            "batch: {per_replica: 8.5}\n",
            1,
            "batch.per_replica: received 8.5, expected an integer >= 1 or null",
        ),
        ("mlflow: {enabled: 'yes'}\n", 1, "mlflow.enabled: received 'yes', expected true or false"),
        (
            "fault_tolerance: {save_freq: 0}\n",
            1,
            "fault_tolerance.save_freq: received 0, expected 'epoch' or an integer",
        ),
        (
            "strategy: {kind: tpu, devices: [/cpu:0]}\n",
            1,
            "devices applies to one_device and mirrored only",
        ),
        (
            "strategy: {kind: default, devices: [/cpu:0]}\n",
            1,
            "devices=\\['/cpu:0'\\] with kind=default; devices applies",
        ),
        (
            "strategy: {kind: one_device, devices: [/cpu:0, /cpu:1]}\n",
            1,
            "received 2 devices for kind=one_device; give at most 1",
        ),
        (
            "strategy: {kind: tpu, simulated_cpu_replicas: 2}\n",
            1,
            "simulated_cpu_replicas does not apply to kind=tpu",
        ),
        (
            "batch: {per_replica: null}\n",
            1,
            "received null for both batch.per_replica and batch.global",
        ),
        ("? [a, b]\n: 1\n", 1, "unknown key \"\\['a', 'b'\\]\""),
        ("mlflow: {run_name: 2001-13-45}\n", 1, "cannot read '2001-13-45' .*; quote it"),
        (
            "strategy:\n  slurm: {port_base: eighty}\n",
            2,
            "strategy.slurm.port_base: received 'eighty', expected 'auto' or an integer from 1 "
            "to 65520 \\(the first of 16 ports\\)",
        ),
        (
            "strategy:\n  slurm: {port_base: 65530}\n",
            2,
            "strategy.slurm.port_base: received 65530, expected 'auto' or an integer from 1 "
            "to 65520 \\(the first of 16 ports\\)",
        ),
    ],
)
def test_each_error_class_has_file_line_and_message(tmp_path, text, line, pattern):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert err.value.file == path and err.value.line == line
    assert len(err.value.issues) == 1
    assert __import__("re").search(pattern, str(err.value)), str(err.value)


def test_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="no such file; create one with 'keras-sync init'"):
        load_config(tmp_path / "missing.yaml", environ={})
    with pytest.raises(ConfigError, match="is a directory, expected a YAML file"):
        load_config(tmp_path, environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"batch:\n  per_replica: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: not UTF-8 text \(byte 0xff at offset 22\)"):
        load_config(bad, environ={})


def test_dict_source_errors_name_dict(tmp_path):
    assert load_config({}, environ={}).source == "<dict>"
    with pytest.raises(ConfigError) as err:
        load_config({"batch": {"per_replicas": 3}}, environ={})
    assert str(err.value).startswith(
        "<dict>: batch.per_replicas: unknown key 'per_replicas'; did you mean 'per_replica'?"
    )


def test_config_is_frozen():
    cfg = load_config({}, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch.per_replica = 3  # type: ignore[misc]


# -- sizes: every limit refused in one line, before any work (keras_sync.config.reading) ---------


#: case -> (file text, the one message after the file's path); each limit, refused in one line.
LIMITS = {
    "string": (
        "mlflow:\n  experiment: e\n  run_name: " + "é" * 40_000 + "\n",
        ":3: mlflow.run_name: a string of 80,000 bytes, over the limit of 65,536 "
        "bytes (64 KiB) for a config value; names, paths and URIs are shorter: shorten it",
    ),
    "file_size": (
        "mlflow:\n  run_name: " + "r" * (1024 * 1024) + "\n",
        ": the file is 1,048,597 bytes, over the limit of 1,048,576 bytes (1 MiB) "
        "for a config file; a keras-sync config is a few kilobytes: check that this is "
        "the file you meant",
    ),
    "keys": (
        "strategy:\n  devices:\n" + "    - /cpu:0\n" * 10_001,
        ":10001: strategy.devices[9998]: more than 10,000 keys and list items, the "
        "limit for a config; a keras-sync config has about 40: check that this is the "
        "file you meant",
    ),
    "key_name": (
        "mlflow:\n  " + "k" * 300 + ": 1\n",
        f":2: mlflow.{'k' * 53}...{'k' * 60}: a key of 300 characters, over the "
        "limit of 256 for a key name; the config's keys are words such as run_name "
        "(keras-sync schema lists them)",
    ),
    "digits": (
        "batch:\n  per_replica: " + "1" * 5_000 + "\n",
        ":2: a number of 5,000 digits, more than Python reads; the config's "
        "numbers are small: shorten it",
    ),
    "depth": (
        "".join("  " * i + f"k{i}:\n" for i in range(300)),
        f":33: {'.'.join(f'k{i}' for i in range(32))}: nested more than 32 levels "
        "deep, the limit for a config; its sections nest 3 levels (keras-sync schema "
        "shows them)",
    ),
}


@pytest.mark.parametrize("case", LIMITS)
def test_a_file_over_a_limit_is_refused_in_one_line(tmp_path, case):
    text, message = LIMITS[case]
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert messages(err.value) == [f"{path}{message}"]


def test_a_value_at_the_string_limit_is_read(tmp_path):
    path = write(tmp_path, "mlflow:\n  run_name: " + "r" * 65_536 + "\n")
    assert len(load_config(path, environ={}).mlflow.run_name) == 65_536


def test_a_dict_over_the_limits_is_refused_without_recursion():
    deep: dict = {}
    node = deep
    for _ in range(5_000):  # Python's recursion limit is 1,000
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match=r"^<dict>: a\.a\.a.*: nested more than 32 levels deep"):
        load_config(deep, environ={})
    with pytest.raises(
        ConfigError,
        match=r"^<dict>: mlflow\.run_name: a string of 50,000,000 bytes, over the limit",
    ):
        load_config({"mlflow": {"run_name": "r" * 50_000_000}}, environ={})


def test_environment_and_overrides_are_held_to_the_limits():
    with pytest.raises(ConfigError) as err:
        load_config({}, environ={"MLFLOW_TRACKING_URI": "http://h/" + "p" * 70_000})
    assert messages(err.value) == [
        "$MLFLOW_TRACKING_URI: mlflow.tracking_uri: a string of 70,009 bytes, over the "
        "limit of 65,536 bytes (64 KiB) for a config value; names, paths and URIs are "
        "shorter: shorten it"
    ]
    with pytest.raises(
        ConfigError, match=r"^<overrides>: mlflow\.run_name: a string of 70,000 bytes"
    ):
        load_config({}, overrides={"mlflow.run_name": "r" * 70_000}, environ={})
    with pytest.raises(
        ConfigError, match=r"^<overrides>: a\.a\.a.*: nested more than 32 levels deep"
    ):
        load_config({}, overrides={".".join(["a"] * 2_000): 1}, environ={})
