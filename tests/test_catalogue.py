"""The catalogue the shared laws run over (``tests/catalogue.py``) holds every public
transform and preset: a public builder with no entry fails here."""

from __future__ import annotations

import inspect

import pytest

import muonfx as mfx

import catalogue

LAWS = {catalogue.CONFORMANCE, catalogue.PURITY, catalogue.ELEMENTWISE, catalogue.ZERO, catalogue.EMPTY,
        catalogue.DECLARED, catalogue.SPLIT, catalogue.STATEFUL, catalogue.ADAPTER,
        catalogue.REFUSES, catalogue.LAYOUTS}


def public_builders() -> set[str]:
    """The names of ``muonfx.__all__`` whose signature says they return a transform (or a
    builder of one: ``inject_hyperparams``, ``lr_multiplier``)."""
    out = set()
    for name in mfx.__all__:
        obj = getattr(mfx, name)
        if not callable(obj) or isinstance(obj, type):
            continue
        returns = str(inspect.signature(obj).return_annotation)
        if "GradientTransformation" in returns:
            out.add(name)
    return out


def test_every_public_builder_is_in_the_catalogue():
    builders = public_builders()
    assert {"muon", "adamw", "newton_schulz", "chain", "partition", "inject_hyperparams", "normuon"} <= builders
    missing = sorted(builders - catalogue.covered())
    assert not missing, (f"public builders with no entry in tests/catalogue.py: {missing}; add one line each "
                         "(see its module doc) so that the shared laws run over them")


def test_a_builder_left_out_is_found(monkeypatch):
    """The check above is not vacuous: an entry taken out is reported."""
    monkeypatch.delitem(catalogue.CATALOGUE, "row_normalize_alone")
    monkeypatch.delitem(catalogue.CATALOGUE, "row_normalize")
    assert "row_normalize" in public_builders() - catalogue.covered()


@pytest.mark.parametrize("name", sorted(catalogue.CATALOGUE))
def test_entry_builds_a_transform_and_joins_known_laws(name):
    entry = catalogue.CATALOGUE[name]
    assert entry.laws and entry.laws <= LAWS, entry.laws
    assert entry.kind in (catalogue.ANY, catalogue.MATRIX)
    assert (entry.leafwise is not None) == (catalogue.DECLARED in entry.laws)
    assert set(entry.covers) <= set(mfx.__all__)
    assert isinstance(entry.build(), mfx.GradientTransformation)
