"""Every option celery_zk accepts is documented where users look for it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import celery_zk.broker.transport
from celery_zk.zk.config import ZKOptions

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION_MD = ROOT / "docs" / "configuration.md"
OPTIONS = [f.name for f in dataclasses.fields(ZKOptions)]


@pytest.mark.parametrize("name", OPTIONS)
def test_option_in_configuration_md(name: str) -> None:
    assert f"`{name}`" in CONFIGURATION_MD.read_text(), (
        f"ZKOptions.{name} is missing from docs/configuration.md; add a row for it "
        "to the options table.")


@pytest.mark.parametrize("name", OPTIONS)
def test_option_in_transport_docstring(name: str) -> None:
    assert f"``{name}``" in (celery_zk.broker.transport.__doc__ or ""), (
        f"ZKOptions.{name} is missing from the 'Transport Options' section of the "
        "celery_zk.broker.transport module docstring.")
