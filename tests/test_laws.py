"""Property-based laws of the muonfx transforms (hypothesis).

Each property is a real assertion that fails when the law breaks. Equality is
``torch.equal`` wherever both sides run literally the same arithmetic on the same
tensors (combinator laws, wrappers that must be transparent); a tolerance is used
only where the two sides compute differently, with the reason next to it.

Strategies come from the public :mod:`muonfx.testing` module.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict, TensorDictBase

import muonfx as mfx
from muonfx import schedules
from muonfx.core import key_str
from muonfx.linalg import resolve
from muonfx.testing import matrices, param_tensordicts, params_and_grads, shapes

import catalogue

STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Every tensor here is tiny (sides <= 16): intra-op threads only add OpenMP barriers,
    which stall for milliseconds per matmul on a busy 2-core runner (measured: the same
    Newton-Schulz calls 30x slower with 2 threads under load). Restored afterwards."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


# ---------------------------------------------------------------------------
# tree helpers: snapshots, exact and approximate comparison of states/updates
# ---------------------------------------------------------------------------


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def snapshot(obj: Any) -> Any:
    """A deep copy of a state/updates tree with every tensor cloned."""
    if isinstance(obj, TensorDictBase):
        return obj.clone()
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if _is_namedtuple(obj):
        return type(obj)(*(snapshot(v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(snapshot(v) for v in obj)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    return obj


_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (distinguishes -0.0 from 0.0, equal NaNs compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in _INT_VIEW:
        return torch.equal(a.contiguous().view(_INT_VIEW[a.dtype]), b.contiguous().view(_INT_VIEW[b.dtype]))
    return torch.equal(a, b)


def _td_leaves(td: TensorDictBase) -> dict:
    return {key_str(k): v for k, v in td.items(include_nested=True, leaves_only=True)}


def assert_tree_equal(a: Any, b: Any, path: str = "", bitwise: bool = False) -> None:
    """Exact equality of two trees (TensorDicts, tensors, NamedTuples, tuples, dicts, scalars)."""
    if isinstance(a, TensorDictBase) or isinstance(b, TensorDictBase):
        assert isinstance(a, TensorDictBase) and isinstance(b, TensorDictBase), f"{path}: type differs"
        la, lb = _td_leaves(a), _td_leaves(b)
        assert set(la) == set(lb), f"{path}: keys {sorted(la)} != {sorted(lb)}"
        assert a.batch_size == b.batch_size, f"{path}: batch size differs"
        for k in la:
            assert_tree_equal(la[k], lb[k], f"{path}[{k}]", bitwise)
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{path}: type differs"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        ok = _bits_equal(a, b) if bitwise else torch.equal(a, b)
        assert ok, f"{path}: values differ (max abs diff {(a.double() - b.double()).abs().max().item()})"
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        names = a._fields if _is_namedtuple(a) else range(len(a))
        for n, x, y in zip(names, a, b):
            assert_tree_equal(x, y, f"{path}.{n}", bitwise)
        return
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: dict keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}[{k!r}]", bitwise)
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def grad_sequence(grads: TensorDict, n: int = STEPS) -> list[TensorDict]:
    """``n`` different gradients derived from one draw (sign flips and rescaling)."""
    return [grads.apply(lambda t, i=i: t * ((-0.5) ** i)) for i in range(n)]


def run_steps(tx: mfx.GradientTransformation, params: TensorDict, grads_seq: list[TensorDict]):
    """Outputs (and final state) of ``tx`` over ``grads_seq``, params fixed."""
    state = tx.init(params)
    outs = []
    for g in grads_seq:
        out, state = tx.update(g, state, params)
        outs.append(out)
    return outs, state


def assert_same_outputs(tx1, tx2, params, grads):
    """``tx1`` and ``tx2`` give equal (``torch.equal``) updates over ``STEPS`` steps."""
    seq = grad_sequence(grads)
    outs1, _ = run_steps(tx1, params, seq)
    outs2, _ = run_steps(tx2, params, seq)
    for i, (o1, o2) in enumerate(zip(outs1, outs2)):
        assert_tree_equal(o1, o2, f"step {i}")


MATRIX_DIMS = catalogue.MATRIX_DIMS

# transforms usable on any leaf (0-D .. 4-D); all elementwise or global reductions
ELEMENTWISE: dict[str, Callable[[], mfx.GradientTransformation]] = {
    name: e.build for name, e in catalogue.select(catalogue.ELEMENTWISE).items()}

# ---------------------------------------------------------------------------
# purity: update never mutates updates, state or params, and is deterministic
# ---------------------------------------------------------------------------

ANY, MATRIX = catalogue.ANY, catalogue.MATRIX

PURITY_CASES: dict[str, tuple[str, Callable[[], mfx.GradientTransformation]]] = {
    name: (e.kind, e.build) for name, e in catalogue.select(catalogue.PURITY).items()}


@pytest.mark.parametrize("name", sorted(PURITY_CASES))
@given(data=st.data())
def test_update_is_pure(name, data):
    kind, factory = PURITY_CASES[name]
    params, grads = data.draw(params_and_grads(min_ndim=2 if kind == MATRIX else 0))
    tx = factory()
    state = tx.init(params)
    for i, g in enumerate(grad_sequence(grads, 2)):  # init state, then a non-trivial one
        g_snap, s_snap, p_snap = snapshot(g), snapshot(state), snapshot(params)
        out, new_state = tx.update(g, state, params)
        # nothing the caller passed in was touched (bit for bit)
        assert_tree_equal(g, g_snap, f"step {i} updates", bitwise=True)
        assert_tree_equal(state, s_snap, f"step {i} state", bitwise=True)
        assert_tree_equal(params, p_snap, f"step {i} params", bitwise=True)
        # referential transparency: the same inputs give the same outputs and state
        out2, new_state2 = tx.update(g, state, params)
        assert_tree_equal(out, out2, f"step {i} repeated updates", bitwise=True)
        assert_tree_equal(new_state, new_state2, f"step {i} repeated state", bitwise=True)
        # the output is keyed, shaped and typed like the input
        lo, lg = _td_leaves(out), _td_leaves(g)
        assert set(lo) == set(lg)
        for k in lg:
            assert lo[k].shape == lg[k].shape and lo[k].dtype == lg[k].dtype, k
        state = new_state


# ---------------------------------------------------------------------------
# combinator laws
# ---------------------------------------------------------------------------

elementwise_names = st.sampled_from(sorted(ELEMENTWISE))


@given(params_and_grads(), elementwise_names)
def test_chain_identity_is_unit(pg, name):
    params, grads = pg
    t = ELEMENTWISE[name]()
    # same transform, same tensors, nothing in between: bitwise the same outputs
    assert_same_outputs(mfx.chain(mfx.identity(), t), t, params, grads)
    assert_same_outputs(mfx.chain(t, mfx.identity()), t, params, grads)
    assert_same_outputs(mfx.chain(mfx.identity()), mfx.identity(), params, grads)
    assert_same_outputs(mfx.chain(), mfx.identity(), params, grads)


@given(params_and_grads(), elementwise_names, elementwise_names, elementwise_names)
def test_chain_is_associative(pg, a, b, c):
    params, grads = pg
    ta, tb, tc = ELEMENTWISE[a](), ELEMENTWISE[b](), ELEMENTWISE[c]()
    assert_same_outputs(mfx.chain(mfx.chain(ta, tb), tc), mfx.chain(ta, mfx.chain(tb, tc)), params, grads)
    # and both equal the flat chain and the named chain
    assert_same_outputs(mfx.chain(ta, tb, tc), mfx.chain(ta, mfx.chain(tb, tc)), params, grads)
    assert_same_outputs(mfx.named_chain(("a", ta), ("b", tb), ("c", tc)), mfx.chain(ta, tb, tc), params, grads)


@given(params_and_grads(), st.sampled_from(sorted(ELEMENTWISE) + ["newton_schulz", "muon"]), st.booleans())
def test_masked_all_false_is_identity(pg, name, as_mapping):
    params, grads = pg
    # newton_schulz / muon would raise on 0-D/1-D leaves: an all-false mask must never call them on any leaf
    inner = {"newton_schulz": mfx.newton_schulz, "muon": mfx.muon}.get(name, ELEMENTWISE.get(name))()
    mask = {key_str(k): False for k in params.keys(True, True)} if as_mapping else (lambda k, t: False)
    tx = mfx.masked(inner, mask)
    seq = grad_sequence(grads)
    outs, _ = run_steps(tx, params, seq)
    for i, (g, o) in enumerate(zip(seq, outs)):
        assert_tree_equal(o, g, f"step {i}", bitwise=True)


@given(params_and_grads(), st.data())
def test_masked_all_true_is_inner(pg, data):
    params, grads = pg
    name = data.draw(elementwise_names)
    t = ELEMENTWISE[name]()
    # the inner transform sees the same leaves: bitwise the same
    assert_same_outputs(mfx.masked(t, lambda k, x: True), t, params, grads)


@given(params_and_grads(), elementwise_names, elementwise_names, st.data())
def test_partition_equals_chain_of_masked(pg, a, b, data):
    params, grads = pg
    ks = [key_str(k) for k in params.keys(True, True)]
    lbls = data.draw(st.lists(st.sampled_from("xy"), min_size=len(ks), max_size=len(ks)))
    labels = dict(zip(ks, lbls))
    ta, tb = ELEMENTWISE[a](), ELEMENTWISE[b]()
    part = mfx.partition({"x": ta, "y": tb}, labels)
    via_masks = mfx.chain(
        mfx.masked(ta, {k: v == "x" for k, v in labels.items()}),
        mfx.masked(tb, {k: v == "y" for k, v in labels.items()}),
    )
    # each leaf goes through exactly one transform, computed on the same share of leaves
    # (global norms included): bitwise the same
    assert_same_outputs(part, via_masks, params, grads)
    # the label function form routes the same way as the mapping form
    assert_same_outputs(mfx.partition({"x": ta, "y": tb}, lambda k, t: labels[k]), part, params, grads)


@given(params_and_grads(), st.sampled_from(sorted(ELEMENTWISE) + ["adamw", "muon_adamw", "muon_masked"]))
def test_accumulate_one_is_inner(pg, name):
    params, grads = pg
    factory = {
        "adamw": lambda: mfx.adamw(weight_decay=0.1),
        "muon_adamw": lambda: mfx.muon_adamw(weight_decay=0.1),
        "muon_masked": lambda: mfx.mask_by_ndim(mfx.muon(), MATRIX_DIMS),
    }.get(name) or ELEMENTWISE[name]
    t = factory()
    # every_k=1 adds the update to a zero buffer (exact) and skips the division: bitwise the same
    assert_same_outputs(mfx.accumulate(t, 1), t, params, grads)


@given(params_and_grads(), elementwise_names)
def test_apply_if_finite_is_transparent_on_finite_updates(pg, name):
    params, grads = pg
    t = ELEMENTWISE[name]()
    assert_same_outputs(mfx.apply_if_finite(t), t, params, grads)


# ---------------------------------------------------------------------------
# inject_hyperparams with constant values is the plain factory
# ---------------------------------------------------------------------------

lrs = st.floats(1e-4, 0.1)
betas = st.floats(0.0, 0.99)
wds = st.sampled_from([0.0, 0.01, 0.1])


@st.composite
def factory_and_kwargs(draw):
    which = draw(st.sampled_from(["muon", "adamw", "momentum", "scale_by_adam", "muon_adamw"]))
    if which == "muon":
        kw = dict(lr=draw(lrs), momentum=draw(betas), weight_decay=draw(wds),
                  nesterov=draw(st.booleans()), ns_steps=draw(st.integers(1, 6)),
                  ns_coefficients=draw(st.sampled_from(["keller", "you", "polar_express"])))
        return which, mfx.muon, kw
    if which == "muon_adamw":
        kw = dict(lr=draw(lrs), momentum=draw(betas), adamw_lr=draw(lrs), adamw_weight_decay=draw(wds))
        return which, mfx.muon_adamw, kw
    if which == "adamw":
        kw = dict(lr=draw(st.one_of(lrs, st.just(schedules.cosine_decay(1e-3, 4)))),
                  weight_decay=draw(wds), eps=draw(st.sampled_from([1e-8, 1e-6])),
                  betas=(draw(betas), draw(st.floats(0.9, 0.999))))
        return which, mfx.adamw, kw
    if which == "momentum":
        return which, mfx.momentum, dict(beta=draw(betas), nesterov=draw(st.booleans()))
    return which, mfx.scale_by_adam, dict(b1=draw(betas), b2=draw(st.floats(0.9, 0.999)),
                                          eps=draw(st.sampled_from([1e-8, 1e-3])))


@given(params_and_grads(min_ndim=0), factory_and_kwargs())
def test_inject_hyperparams_constant_equals_factory(pg, fk):
    params, grads = pg
    which, factory, kw = fk
    plain = factory(**kw)
    injected = mfx.inject_hyperparams(factory)(**kw)
    state = injected.init(params if which != "muon" else TensorDict({}, []))
    assert isinstance(state, mfx.InjectHyperparamsState)
    # every numeric argument (not bools, not tuples) is live in the state, at its given value
    numeric = {n: v for n, v in kw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {n: v for n, v in state.hyperparams.items() if n in numeric} == numeric
    if which == "muon":  # muon needs matrices: run both on the matrix leaves only
        plain, injected = mfx.mask_by_ndim(plain, MATRIX_DIMS), mfx.mask_by_ndim(injected, MATRIX_DIMS)
    # the injected transform runs the same arithmetic on the same values (its chain built
    # once, with the late-bound numbers passed at each step): bitwise the same
    assert_same_outputs(injected, plain, params, grads)


# ---------------------------------------------------------------------------
# Newton-Schulz
# ---------------------------------------------------------------------------

# Singular-value bands after 5 steps. The NS map acts on each normalised singular
# value sigma / ||X||_F by a fixed scalar polynomial p; for cond <= 10 and sides <= 16,
# sigma / ||X||_F lies in [1/40, 1]. The exact image of that interval under p,
# measured on a 2e5-point grid (and matched by 3000 random matrices), is
#   keller        [0.6818, 1.1344]   (muon-facts.md section 2: [0.68, 1.13])
#   you           [0.9778, 1.0318]   (facts: [0.98, 1.03])
#   polar_express [0.8589, 1.1411]   (facts: [0.86, 1.14], safety 1.02)
# The bands below add a 0.005-0.008 margin for rounding; they are far tighter than the
# margins an off-by-one step count or a wrong coefficient would need to pass.
NS_BANDS = {"keller": (0.675, 1.14), "you": (0.97, 1.04), "polar_express": (0.85, 1.15)}


# muon-facts.md section 2, measured on 1024 x 4096 Gaussian matrices
REFERENCE_BANDS = {"keller": (0.68, 1.13), "you": (0.98, 1.03), "polar_express": (0.86, 1.14)}


@pytest.mark.parametrize("name", sorted(REFERENCE_BANDS))
def test_ns_schedule_band_matches_reference(name):
    """The image of the normalised singular values [1/40, 1] under the preset's scalar
    polynomial is the published band (to 0.01). Band containment alone cannot catch a
    coefficient typo that narrows the band; this pins the presets to the reference."""
    sch = resolve(name, 5)
    x = torch.linspace(1 / 40, 1.0, 100_001, dtype=torch.float64) / sch.safety
    for a, b, c in sch.steps:
        x = a * x + b * x**3 + c * x**5
    lo, hi = REFERENCE_BANDS[name]
    assert abs(x.min().item() - lo) < 0.01 and abs(x.max().item() - hi) < 0.01, (x.min().item(), x.max().item())


def _ns(x: torch.Tensor, **kw) -> torch.Tensor:
    tx = mfx.newton_schulz(**kw)
    out, _ = tx.update(TensorDict({"w": x}, []), tx.init(TensorDict({"w": x}, [])))
    return out["w"]


ns_methods = st.sampled_from(["auto", "standard", "gram", "spectral"])


@given(st.sampled_from([torch.float64, torch.float32]).flatmap(
    lambda dt: matrices(max_side=16, max_cond=10.0, dtype=dt)), st.sampled_from(sorted(NS_BANDS)), ns_methods)
def test_newton_schulz_singular_values_in_band(x, name, method):
    # compute in the input dtype (CPU default); float32 lands in the same bands (measured,
    # 1500 draws per schedule and method: within 2.5e-4 of the float64 extremes)
    y = _ns(x, coefficients=name, method=method)
    assert y.dtype == x.dtype and y.shape == x.shape
    s = torch.linalg.svdvals(y.double())
    lo, hi = NS_BANDS[name]
    assert s.min().item() >= lo and s.max().item() <= hi, (name, method, s.min().item(), s.max().item())


@given(matrices(max_side=12, max_cond=10.0), st.sampled_from(["keller", "you", "polar_express", "cubic"]),
       st.integers(1, 6), ns_methods)
def test_newton_schulz_is_spectral_polynomial(x, name, steps, method):
    """NS(X) = U p(sigma) V^T: singular vectors kept, each singular value mapped by the
    schedule's scalar polynomial (oracle from the SVD, in float64); the standard and the
    Gram-matrix iterations are both this function."""
    sch = resolve(name, steps)
    y = _ns(x, coefficients=name, steps=steps, method=method)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    sig = s / (torch.linalg.vector_norm(x) * sch.safety)
    for a, b, c in sch.steps:
        sig = a * sig + b * sig**3 + c * sig**5
    expected = (u * sig) @ vh
    # different float64 evaluation orders; measured max deviation 3e-14 over 800 draws
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-10)


@given(matrices(max_side=16), st.sampled_from(sorted(NS_BANDS)), st.sampled_from(["gram", "spectral"]))
def test_newton_schulz_gram_and_spectral_equal_standard(x, name, method):
    # the same polynomial of X X^T applied to X, multiplied out in another order (gram)
    # or evaluated on the eigenvalues of X X^T (spectral)
    torch.testing.assert_close(_ns(x, coefficients=name, method=method),
                               _ns(x, coefficients=name, method="standard"), rtol=0, atol=1e-11)


@given(matrices(max_side=16), st.floats(-3.0, 3.0), st.sampled_from(sorted(NS_BANDS)), ns_methods)
def test_newton_schulz_scale_invariant(x, log_c, name, method):
    c = 10.0**log_c
    # float64: the only difference is the rounding of c*X and of its norm (~1e-16),
    # amplified by at most ~1e3 through 5 steps; measured max deviation 3e-14
    torch.testing.assert_close(_ns(c * x, coefficients=name, method=method),
                               _ns(x, coefficients=name, method=method), rtol=0, atol=1e-11)


@given(matrices(max_side=16), st.sampled_from(sorted(NS_BANDS)), ns_methods)
def test_newton_schulz_commutes_with_transpose(x, name, method):
    # p(X X^T) X == X p(X^T X) exactly in real arithmetic; float64 rounding differs
    # (square inputs iterate on the other Gram matrix): measured max deviation 2e-14
    torch.testing.assert_close(_ns(x.T.contiguous(), coefficients=name, method=method),
                               _ns(x, coefficients=name, method=method).T, rtol=0, atol=1e-11)


@given(st.integers(2, 4), st.data())
def test_newton_schulz_matrices_are_independent(n, data):
    """Batched (same-shape leaves, 3-D stacks) equals one matrix at a time."""
    stack = data.draw(matrices(max_side=8, batch=n))
    one_by_one = torch.stack([_ns(m) for m in stack])
    # a 3-D leaf is a batch of independent matrices
    torch.testing.assert_close(_ns(stack), one_by_one, rtol=0, atol=1e-12)
    # several same-shape leaves are concatenated into one batch by the seam
    td = TensorDict({f"m{i}": m for i, m in enumerate(stack)}, [])
    tx = mfx.newton_schulz()
    out, _ = tx.update(td, tx.init(td))
    for i in range(n):
        torch.testing.assert_close(out[f"m{i}"], one_by_one[i], rtol=0, atol=1e-12)
    # a 4-D leaf is the matrix [out, in*kh*kw]
    conv = stack.reshape(n, stack.shape[1], 1, stack.shape[2])
    torch.testing.assert_close(_ns(conv), _ns(conv.reshape(n, -1)).reshape(conv.shape), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------
# zero gradients give zero updates, never NaN
# ---------------------------------------------------------------------------

ZERO_CASES: dict[str, tuple[str, Callable[[], mfx.GradientTransformation]]] = {
    name: (e.kind, e.build) for name, e in catalogue.select(catalogue.ZERO).items()}


@pytest.mark.parametrize("name", sorted(ZERO_CASES))
@given(data=st.data())
def test_zero_gradient_gives_zero_update(name, data):
    kind, factory = ZERO_CASES[name]
    params = data.draw(param_tensordicts(min_ndim=2 if kind == MATRIX else 0))
    zeros = params.apply(torch.zeros_like)
    tx = factory()
    state = tx.init(params)
    for i in range(STEPS):
        out, state = tx.update(zeros, state, params)
        for k, v in _td_leaves(out).items():
            assert not v.isnan().any(), f"step {i} [{k}]: NaN in the update of a zero gradient"
            assert (v == 0).all(), f"step {i} [{k}]: nonzero update for a zero gradient"


EMPTY_CASES: dict[str, tuple[str, Callable[[], mfx.GradientTransformation]]] = {
    name: (e.kind, e.build) for name, e in catalogue.select(catalogue.EMPTY).items()}


@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
@settings(max_examples=max(5, settings.default.max_examples // 2))
@given(data=st.data())
def test_empty_leaves_pass_through(name, data):
    """Leaves with a zero-sized side (e.g. ``nn.Linear(0, n)``) are legal: every transform
    keeps their shape and dtype, and the other leaves stay finite."""
    kind, factory = EMPTY_CASES[name]
    shape_st = shapes(2 if kind == MATRIX else 0, 4, max_side=3, min_side=0)
    params, grads = data.draw(params_and_grads(shapes=shape_st))
    tx = factory()
    state = tx.init(params)
    for g in grad_sequence(grads, 2):
        out, state = tx.update(g, state, params)
        lo, lg = _td_leaves(out), _td_leaves(g)
        assert set(lo) == set(lg)
        for k, v in lo.items():
            assert v.shape == lg[k].shape and v.dtype == lg[k].dtype, k
            assert torch.isfinite(v).all(), k


# ---------------------------------------------------------------------------
# apply_updates
# ---------------------------------------------------------------------------


@given(param_tensordicts(), st.data())
def test_apply_updates_keeps_param_dtypes(params, data):
    updates = params.apply(lambda p: torch.randn(p.shape, generator=torch.Generator().manual_seed(
        data.draw(st.integers(0, 2**31 - 1))), dtype=torch.float32))
    p_snap, u_snap = snapshot(params), snapshot(updates)
    new = mfx.apply_updates(params, updates)
    assert_tree_equal(params, p_snap, "params", bitwise=True)
    assert_tree_equal(updates, u_snap, "updates", bitwise=True)
    lp, lu, ln = _td_leaves(params), _td_leaves(updates), _td_leaves(new)
    assert set(ln) == set(lp)
    for k, p in lp.items():
        assert ln[k].dtype == p.dtype and ln[k].shape == p.shape, k
        # the documented formula: (p + u) in the promoted dtype, cast back to p's dtype
        wide = torch.promote_types(p.dtype, torch.float32)
        assert torch.equal(ln[k], (p.to(wide) + lu[k].to(wide)).to(p.dtype)), k
