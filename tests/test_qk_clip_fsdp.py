"""QK-clip on FSDP2 (2 gloo ranks): the statistics reduced by one MAX all-reduce, each
rank's rows of the (unevenly sharded) fused QKV scaled where they are; one process's
result."""

from __future__ import annotations

import pytest

from dist_harness import run_world

import qk_workers as qw

pytestmark = pytest.mark.slow


def test_fsdp2_equals_one_process():
    results = run_world(qw.qk_clip_fsdp, 2, timeout=240)
    for r in results:
        assert sum(r["clipped"]) > 0, r  # heads were clipped
        assert r["reset"]
        worst = max(r["errors"].values())
        assert worst < 2e-6, r["errors"]  # measured 4.0e-7 (proj.weight), 2-core x86, torch 2.13


def test_a_rank_without_statistics_makes_every_rank_raise():
    results = run_world(qw.missing_on_one_rank, 2, timeout=240)
    assert results[0] == results[1]
    assert "no attention logits recorded this step for ['attn'] (on some rank)" in results[0]
