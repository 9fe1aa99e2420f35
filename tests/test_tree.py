"""muonfx.tree, the one walker of state trees: its own walk of dicts, tuples, lists and
NamedTuples gives ``torch.utils._pytree``'s leaves in its order and builds the same trees
back (other containers go to pytree), and ``merge_parts`` puts disjoint parts back as a
merge of each in turn would."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
from torch.utils import _pytree as pytree

import muonfx as mfx
from muonfx import tree
from muonfx.core import build
from muonfx.counts import from_values, zeros


class Pair(NamedTuple):
    a: object
    b: object


def _td(keys, fill):
    return build([(k,) for k in keys], [torch.full((2,), float(fill + i)) for i, _ in enumerate(keys)])


def _states():
    keys = ["w", "v", "u"]
    yield Pair(zeros([(k,) for k in keys]), {"mu": _td(keys, 0), "lr": 0.1, "flags": [True, None, "x"]})
    yield (torch.ones(3), [Pair(1, (2, 3)), {}], (), {"z": {"y": _td(keys, 5)}})
    yield {"b": 1, "a": Pair(_td(keys, 1), from_values([(k,) for k in keys], [1, 2, 1]))}  # insertion order
    yield collections.OrderedDict(x=_td(keys, 2), y=3)  # another container: pytree's walk
    yield Pair(torch.Size([2, 3]), _td(keys, 3))  # torch.Size is a pytree node
    yield 7
    named = [("w", torch.nn.Parameter(torch.randn(4, 4))), ("b", torch.nn.Parameter(torch.randn(4)))]
    for tx in (mfx.adamw(), mfx.muon_adamw(), mfx.schedule_free_adamw(), mfx.soap()):
        yield tx.init(build([(n,) for n, _ in named], [p for _, p in named]))


@pytest.mark.parametrize("state", list(_states()), ids=lambda s: type(s).__name__)
def test_flatten_gives_pytrees_leaves_and_unflatten_builds_the_same_tree(state):
    leaves, spec = tree.flatten(state)
    ref, ref_spec = pytree.tree_flatten(state, is_leaf=tree._leaf)
    assert len(leaves) == len(ref) and all(a is b for a, b in zip(leaves, ref))
    back = tree.unflatten(leaves, spec)
    again, again_spec = pytree.tree_flatten(back, is_leaf=tree._leaf)
    # pytree's own round trip (it gives a torch.Size back as a tuple)
    ref_back = pytree.tree_flatten(pytree.tree_unflatten(ref, ref_spec), is_leaf=tree._leaf)[1]
    assert again_spec == ref_back and all(a is b for a, b in zip(again, ref))
    if not isinstance(spec, pytree.TreeSpec):  # walked here: equal structures compare equal
        assert tree.flatten(back)[1] == spec


def test_structures_that_differ_compare_unequal():
    keys = ["w"]
    a = tree.flatten(Pair(1, {"x": _td(keys, 0)}))[1]
    assert a != tree.flatten(Pair(1, {"y": _td(keys, 0)}))[1]  # a dict key
    assert a != tree.flatten((1, {"x": _td(keys, 0)}))[1]  # a tuple for the NamedTuple
    assert a != tree.flatten(Pair(1, [_td(keys, 0)]))[1]  # a list for the dict
    assert tree.flatten([1, 2])[1] != tree.flatten((1, 2))[1]


def test_merge_parts_is_a_merge_of_each_part_in_turn():
    keys = ["a", "b", "c", "d"]
    full = Pair(from_values([(k,) for k in keys], [3, 3, 3, 3]), {"mu": _td(keys, 0), "s": 0})
    parts = tree.split(full, [[("a",), ("c",)], [("d",)]])
    new = [Pair(from_values(p.a.keys, [4] * len(p.a.keys)), {"mu": p.b["mu"].apply(lambda t: t + 10), "s": i + 1})
           for i, p in enumerate(parts)]
    once = tree.merge_parts(full, new)
    each = full
    for p in new:
        each = tree.merge(each, p)
    assert tree.flatten(once)[1] == tree.flatten(each)[1]
    assert once.a == each.a and once.a.keys == full.a.keys and muonfx_counts(once.a) == [4, 3, 4, 4]
    for k in keys:
        assert torch.equal(once.b["mu"][k], each.b["mu"][k])
    assert torch.equal(once.b["mu"]["b"], full.b["mu"]["b"]) and torch.equal(once.b["mu"]["a"], full.b["mu"]["a"] + 10)
    assert once.b["s"] == each.b["s"] == 2  # the last part's scalars
    assert tree.merge_parts(full, []) is full


def muonfx_counts(c):
    from muonfx.counts import values_of

    return values_of(c)
