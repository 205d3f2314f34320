"""The kinds table: every question about a strategy kind is answered by its entry, and the answers agree."""

from __future__ import annotations

import doctest

import pytest

from keras_sync.config import kinds, load_config
from keras_sync.config.kinds import KINDS, LAYOUTS, STRATEGY_KINDS
from keras_sync.errors import ConfigError


def test_doctests_hold() -> None:
    assert doctest.testmod(kinds).failed == 0


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_entry_is_complete(kind: str) -> None:
    spec = KINDS[kind]
    assert spec.name == kind and spec.summary.startswith(f"{kind}: ")
    assert spec.layout in LAYOUTS
    assert (spec.builder is None) == (kind == "auto")
    assert spec.max_devices is None or spec.accepts_devices


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_config_accepts_devices_exactly_where_the_table_says(kind: str) -> None:
    data = {"strategy": {"kind": kind, "devices": ["/cpu:0"]}}
    if KINDS[kind].accepts_devices:
        assert load_config(data, environ={}).strategy.devices == ("/cpu:0",)
    else:
        with pytest.raises(
            ConfigError, match=f"with kind={kind}; devices applies to one_device and mirrored only"
        ):
            load_config(data, environ={})


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_config_accepts_simulated_cpus_exactly_where_the_table_says(kind: str) -> None:
    data = {"strategy": {"kind": kind, "simulated_cpu_replicas": 2}}
    if KINDS[kind].simulated_cpus:
        assert load_config(data, environ={}).strategy.simulated_cpu_replicas == 2
    else:
        with pytest.raises(
            ConfigError, match=f"simulated_cpu_replicas does not apply to kind={kind}; remove it"
        ):
            load_config(data, environ={})


@pytest.mark.parametrize("kind", STRATEGY_KINDS)
def test_template_shows_simulated_cpu_replicas_exactly_where_the_config_accepts_it(
    kind: str,
) -> None:
    from pathlib import Path

    template = (
        Path(__file__).resolve().parents[1] / "templates" / f"strategy_{kind}.yaml"
    ).read_text()
    try:
        load_config({"strategy": {"kind": kind, "simulated_cpu_replicas": 2}}, environ={})
        accepted = True
    except ConfigError:
        accepted = False
    assert ("simulated_cpu_replicas:" in template) == accepted == KINDS[kind].simulated_cpus


def test_plan_counts_workers_only_for_multi_process_kinds() -> None:
    import json

    from keras_sync.cli.plan import make_plan

    two = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
            "task": {"type": "worker", "index": 0},
        }
    )
    for kind in ("default", "mirrored", "multi_worker_mirrored"):
        plan = make_plan(
            load_config({"strategy": {"kind": kind}}, environ={}), environ={"TF_CONFIG": two}
        )
        workers = next(i.value for i in plan.items if i.key == "workers")
        assert workers == (2 if KINDS[kind].multi_process else 1), kind
