"""One source per default: the flags the operator writes for an LLMService parse, through the real `slofleet serve`
argument parser, into the engine's own defaults; every shared or mapped CRD field reaches its flag."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from slofleet.api.contract import ENGINE_SETTINGS
from slofleet.api.v1alpha1 import Engine, LLMService
from slofleet.engine.config import EngineConfig
from slofleet.engine.server import cli
from slofleet.engine.server.settings import ServerSettings
from slofleet.operator.podspec import serve_args

# CRD engine field -> the `slofleet serve` setting it sets, where the names differ.
MAPPED = {"port": "port", "drain_seconds": "grace_period", "price_per_hour": "price_per_hour"}
# Fields of spec.engine that shape the pod rather than the engine process.
POD_ONLY = {"runtime", "image", "image_pull_policy", "resources", "gpus", "startup_seconds", "env", "args"}


def parsed(engine: dict) -> tuple[EngineConfig, ServerSettings]:
    svc = LLMService.model_validate({"metadata": {"name": "x"}, "spec": {"engine": engine}})
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(serve_args(svc, "unified", []))
    return cli._from_args(EngineConfig, args), cli._from_args(ServerSettings, args)


def test_every_crd_engine_field_is_mapped_or_pod_only():
    known = set(ENGINE_SETTINGS) | set(MAPPED) | POD_ONLY
    assert set(Engine.model_fields) == known, set(Engine.model_fields) ^ known


def test_defaults_are_the_engines():
    config, settings = parsed({})
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("model", "served_model_name", "role"):  # the resource's own
            assert getattr(config, f.name) == getattr(defaults, f.name), f.name
    assert settings.port == ServerSettings().port and settings.grace_period == ServerSettings().grace_period
    crd = Engine()
    for crd_name, serve_name in MAPPED.items():
        assert getattr(crd, crd_name) == getattr(ServerSettings(), serve_name), crd_name
    for name in ENGINE_SETTINGS:
        assert getattr(crd, name) == getattr(defaults, name), name


def other_value(name: str):
    s = ENGINE_SETTINGS[name]
    if isinstance(s.default, bool):
        return not s.default
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    return s.default * 2 or 4  # a setting off at 0 is on at 4


@pytest.mark.parametrize("name", [*ENGINE_SETTINGS, *MAPPED])
def test_a_non_default_value_reaches_its_flag(name):
    serve_name = MAPPED.get(name, name)
    value = {"port": 8001, "drain_seconds": 45, "price_per_hour": 2.5}.get(name) or other_value(name)
    config, settings = parsed({name: value})
    got = getattr(settings if name in MAPPED else config, serve_name)
    assert got == value


def test_args_pass_through_for_flags_the_schema_does_not_name():
    config, _ = parsed({"args": ["--seed", "7", "--no-cuda-graphs"]})
    assert config.seed == 7 and config.cuda_graphs is False
