"""A Muon optimizer in which no parameter reaches Newton-Schulz raises, naming why; the
routing (route and rule per parameter) shows in describe(opt) and print(opt.plan)."""

from __future__ import annotations

import pytest
import torch

import muonfx as mfx
from muonfx.distributed import describe
from muonfx.optim.routing import NoMuonError


class Flat(torch.nn.Module):
    """FSDP1-style: the whole model as one flat 1-D parameter."""

    def __init__(self):
        super().__init__()
        self.flat_param = torch.nn.Parameter(torch.zeros(12288))


def _embed_norm():
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.LayerNorm(8))


class Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 8)


BUILDERS = {
    "MuonOptimizer": lambda m, **kw: mfx.MuonOptimizer(m, **kw),
    "create_hybrid_optimizer": lambda m, **kw: mfx.create_hybrid_optimizer(m, **kw),
    "FSDPMuonOptimizer": lambda m, **kw: mfx.FSDPMuonOptimizer(m, **kw),
}
CASES = {
    "flattened": (Flat, r"arrive flattened \(1-D: 'flat_param' \(12288,\)\)"),
    "embedding": (_embed_norm, r"every matrix matched an embedding/head rule.*'0.weight' \(10, 8\) "
                               r"\(nn.Embedding module\)"),
    "head name": (Heads, r"every matrix matched.*'lm_head.weight' \(8, 8\) \(name 'lm_head' matches"),
    "no matrix": (lambda: torch.nn.LayerNorm(8), r"no parameter is at least 2-D"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_no_muon_parameter_raises_naming_why(builder, case):
    make, why = CASES[case]
    with pytest.raises(NoMuonError, match=f"^{builder}: no parameter gets Muon: .*{why}.*allow_no_muon=True"):
        BUILDERS[builder](make())
    opt = BUILDERS[builder](make(), allow_no_muon=True)  # those who mean it
    assert all(route == "adamw" for _, _, route, _ in opt.routing)


def test_plain_parameters_without_matrices_raise():
    with pytest.raises(NoMuonError, match="MuonOptimizer: .*flattened"):
        mfx.MuonOptimizer([torch.nn.Parameter(torch.zeros(12288))])


def test_cli_matrix_optimizer_guard():
    from muonfx.cli.optimizers import build_optimizer

    with pytest.raises(NoMuonError, match="--optimizer muon: .*flattened"):
        build_optimizer("muon", Flat(), 0.02, 1e-3, 0.0)


def test_routing_shows_in_describe_and_the_plan():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    opt = mfx.create_hybrid_optimizer(model)
    assert opt.routing == [("0.weight", (10, 8), "adamw", "nn.Embedding module"),
                           ("1.weight", (8, 8), "muon", "matrix"), ("1.bias", (8,), "adamw", "0-D/1-D")]
    text = str(opt.plan)
    assert ("routing: adamw: 2 parameters ('0.weight' by nn.Embedding module, '1.bias' by 0-D/1-D); "
            "muon: 1 parameter ('1.weight' by matrix)") in text
    rows = {r["parameter"]: r["route"] for r in describe(opt).rows}
    assert rows == {"0.weight": "adamw (nn.Embedding module)", "1.weight": "muon (matrix)", "1.bias": "adamw (0-D/1-D)"}
