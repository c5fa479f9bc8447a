"""Requests name the model by the LLMService's name, or by spec.model.servedName: the operator passes that name
to every engine role through the real `slofleet serve` parser, and the CRD refuses a name the engine would split."""
from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from slofleet.api.contract import ROLES
from slofleet.api.v1alpha1 import LLMService
from slofleet.engine.config import EngineConfig
from slofleet.engine.server import cli
from slofleet.operator.podspec import serve_args


def served(model: dict, role: str = "unified") -> str:
    svc = LLMService.model_validate({"metadata": {"name": "chat"}, "spec": {"model": model}})
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli._from_args(EngineConfig, parser.parse_args(serve_args(svc, role, []))).served_model_name


@pytest.mark.parametrize("role", ROLES)
def test_engines_answer_to_the_service_name_by_default(role):
    assert served({}, role) == "chat"  # not the spec's model.name ('default'), nor empty (the weights' name only)


def test_served_name_wins():
    assert served({"servedName": "smol-chat"}) == "smol-chat"


@pytest.mark.parametrize("bad", ["a,b", "two words", ""])
def test_a_served_name_the_engine_would_split_is_refused(bad):
    with pytest.raises(ValidationError, match="served_name|servedName"):
        LLMService.model_validate({"metadata": {"name": "chat"}, "spec": {"model": {"servedName": bad}}})
