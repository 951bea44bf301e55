"""Numerical probes that classify distribution arguments at compile time.

Each argument the forms (:func:`blrppl.model.classes.classify_form`) leave undecided is a
function of the neighbouring blocks, probed by autodiff at random points of the blocks
(:func:`probe_argument`): second directional derivatives and secants tell affine maps and
powers, squared JVPs along random sign patterns over plate elements tell whether an
argument reads one plate element per output element (the squared directional derivative is
the same for every pattern exactly when a single element contributes). The probes of every
argument of a model run in one compiled call (:func:`run_probes`); their decisions are
:class:`blrppl.model.classes.ArgumentClass` objects.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.runtime.compile import compile_lowered, compiler_options, jit as _jit
from blrppl.graph.plan import Block
from blrppl.model.classes import OPAQUE, ArgumentClass, block_power, needs_gather_test
from blrppl.moments import kinds as mom


_NUM_SIGN_PATTERNS = 16
_NUM_PROBES = 2


def random_point(block: Block, rng: np.random.Generator) -> np.ndarray:
    """A random value of a block's site, inside its support (host-side numpy)."""
    shape = block.value_shape
    if block.discrete:
        return rng.choice(np.asarray(block.support_values), size=shape)
    return block.family.random_value(rng, shape)


def _second_derivative(fn, point, tangent):
    """d²/ds² fn(point + s·tangent) at s = 0 (forward over forward: exact zeros for affine fn)."""

    def first(s):
        return fn(jax.tree.map(lambda p, t: p + s * t, point, tangent))

    def d1(s):
        return jax.jvp(first, (s,), (jnp.ones_like(s),))[1]

    s0 = jnp.zeros(())
    return jax.jvp(d1, (s0,), (jnp.ones_like(s0),))[1]


def _sign_tangents(block: Block, rng: np.random.Generator, elementwise: bool):
    """Random sign patterns over the block's elements (or plate elements), site layout."""
    if elementwise:
        signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + block.value_shape)
        return signs * np.exp(0.3 * rng.normal(size=block.value_shape))
    bshape = block.batch_shape
    dim = math.prod(block.value_shape) // max(math.prod(bshape), 1)
    signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + bshape + (1,))
    canon = signs * rng.normal(size=(dim,))
    return np.stack([block.to_site(c) for c in canon])


def _whole_tangents(block: Block, rng: np.random.Generator):
    """Random signs over a matrix-valued block's elements times one coded matrix C
    (C_ij = iD + j + 1): the JVP of an argument that reads whole matrices in place (a
    gather, a broadcast, a transpose) squares to C² or (Cᵀ)² in every output matrix."""
    dim = block.value_shape[-1]
    signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + tuple(block.value_shape[:-2]) + (1, 1))
    return signs * _code_matrix(dim)


def _code_matrix(dim: int) -> np.ndarray:
    return np.arange(1.0, dim * dim + 1.0).reshape(dim, dim)


def _whole_ok(sq, dim: int) -> bool:
    """Whether every output matrix of the squared JVPs ``sq`` is c² C² or c² (Cᵀ)² for one
    c ≠ 0 per matrix (whole matrices read in place, each times a constant)."""
    sq = np.asarray(sq)
    if sq.ndim < 3 or sq.shape[-2:] != (dim, dim):
        return False
    code = np.square(_code_matrix(dim))
    c2 = sq[..., :1, :1]  # c² from C₀₀ = 1
    if not np.all(np.isfinite(sq)) or np.any(c2 <= 0):
        return False
    tol = 1e-5 if sq.dtype == np.float64 else 1e-3
    as_is = np.all(np.abs(sq - c2 * code) <= tol * c2 * code, axis=(-2, -1))
    transposed = np.all(np.abs(sq - c2 * code.T) <= tol * c2 * code, axis=(-2, -1))
    return bool(np.all(as_is | transposed))


@dataclasses.dataclass
class ArgumentProbe:
    """Probes of one argument: host-side random inputs, a traceable computation of the probe
    values, and the decision taken from them.

    ``compute(inputs, data)`` is pure JAX so that the probes of every argument of a model run
    in one compiled call; ``decide(outputs)`` runs on the host.
    """

    group: str
    cont: tuple
    inputs: dict
    compute: Callable | None
    decide: Callable


def probe_argument(fn, deps: frozenset, blocks: dict, rng: np.random.Generator) -> ArgumentProbe:
    """Plan the probes that classify ``fn(values, data)`` (a function of latent site values).

    Args:
        fn: maps (dict of latent site values, data) to the argument.
        deps: names of the blocks the argument depends on (structurally).
        blocks: name → :class:`Block` for every latent site.
        rng: host random generator for probe points.
    """
    cont = tuple(n for n in deps if not blocks[n].discrete)
    disc = tuple(n for n in deps if blocks[n].discrete)
    if not cont:
        return ArgumentProbe("const", (), {}, None, lambda out: ArgumentClass("const", ()))
    if all(blocks[n].point for n in cont):
        # point blocks are seen at their mean: the argument is a constant of the factor's
        # expectation (its value, at the points, still depends on them for their updates)
        return ArgumentProbe("const", (), {}, None, lambda out: ArgumentClass("const", ()))
    gaussian = all(blocks[n].family.gaussian for n in cont)
    if gaussian:
        group = mom.AffineGaussian.kind
    elif len(cont) == 1 and blocks[cont[0]].family.argument_kind is not None:
        # one Gamma, Beta or Dirichlet block: probed for its family's argument kind
        group = blocks[cont[0]].family.argument_kind
    else:
        reason = "depends on several non-Gaussian blocks"
        return ArgumentProbe(
            "opaque", cont, {}, None, lambda out: ArgumentClass("opaque", cont, reason=reason)
        )

    inputs = {"points": [], "tangents": [], "signs": []}
    for _ in range(_NUM_PROBES):
        inputs["points"].append({n: random_point(blocks[n], rng) for n in cont + disc})
        inputs["tangents"].append({n: rng.normal(size=blocks[n].value_shape) for n in cont})
        signs = {}
        for n in cont:
            elementwise = not gaussian or not blocks[n].family.dense_event
            if needs_gather_test(blocks[n], elementwise):
                signs[n] = _sign_tangents(blocks[n], rng, elementwise)
        inputs["signs"].append(signs)
    # secant targets from the first point: the second point, a reflection (−x for Gaussian
    # blocks, 1/τ for Gamma blocks: across the kinks of abs, relu, max(τ, 1)), a far point
    first, second = inputs["points"][0], inputs["points"][1]
    powers = not gaussian and blocks[cont[0]].family.any_power
    if gaussian:
        inputs["secants"] = [
            {n: second[n] for n in cont},
            {n: -first[n] for n in cont},
            {n: 3.0 * second[n] for n in cont},
        ]
    elif powers:
        inputs["secants"] = [
            {n: second[n] for n in cont},
            {n: 1.0 / first[n] for n in cont},
            {n: second[n] ** 3 for n in cont},
        ]
    if not gaussian and blocks[cont[0]].family.whole_events:
        inputs["whole"] = _whole_tangents(blocks[cont[0]], rng)
    if gaussian:
        compute, decide = _gaussian_probe(fn, cont, blocks)
    elif powers:
        compute, decide = _gamma_probe(fn, cont[0], blocks[cont[0]].family)
    else:
        compute, decide = _identity_probe(fn, cont[0], blocks[cont[0]].family)
    return ArgumentProbe(group, cont, inputs, compute, decide)


def gather_probe(fn, cls: ArgumentClass, blocks: dict, rng: np.random.Generator) -> ArgumentProbe:
    """Confirm a class the forms decided up to the plates (:attr:`ArgumentClass.gather`):
    along random sign patterns over a block's plate elements, the squared JVP of an argument
    reading one plate element per output element does not change. A multiplied block
    (``pairs``) whose elements mix makes the argument opaque; any other block is read
    through its full covariance columns (``full``)."""
    point = {n: random_point(blocks[n], rng) for n in cls.blocks}
    whole = {n for n in cls.gather if blocks[n].family.whole_events}
    signs = {
        n: _whole_tangents(blocks[n], rng) if n in whole else _sign_tangents(blocks[n], rng, not blocks[n].family.dense_event)
        for n in cls.gather
    }

    def compute(inputs, data):
        return {n: _jvp_squares(fn, inputs["point"], n, s, data) for n, s in inputs["signs"].items()}

    def decide(outputs) -> ArgumentClass:
        broken = sorted(n for n in whole if not _whole_ok(outputs[n], blocks[n].value_shape[-1]))
        if broken:
            family = blocks[broken[0]].family.name.capitalize()
            reason = f"reads parts of the {family} matrices of '{broken[0]}', or mixes them (not whole matrices)"
            return ArgumentClass(OPAQUE, cls.blocks, reason=reason)
        mixed = sorted(n for n, sq in outputs.items() if n not in whole and not _gather_ok(sq))
        multiplied = {n for pair in cls.pairs for n in pair}
        bad = [n for n in mixed if n in multiplied]
        if bad:
            reason = f"a contraction of products of latents over the plate elements of '{bad[0]}'"
            return ArgumentClass(OPAQUE, cls.blocks, reason=reason)
        return dataclasses.replace(cls, gather=(), full=tuple(sorted(set(cls.full) | set(mixed))))

    return ArgumentProbe(cls.kind, cls.blocks, {"point": point, "signs": signs}, compute, decide)


def pairing_probe(fn, shared: dict, point: dict, blocks: dict, rng: np.random.Generator) -> ArgumentProbe:
    """Plan the probe that tells which plated Gaussian blocks a factor's arguments read at
    different elements (``value = x[1:]`` with ``loc = x[:-1]``): each argument alone reads
    one plate element per output element, yet the pair couples neighbours.

    Along a tangent m and its products s ⊙ m with random sign patterns s over the plate
    elements, an argument a reading element p_a(n) at output n has J_a(s ⊙ m)_n =
    s_{p_a(n)} J_a(m)_n; two arguments read the same element exactly when their ratios agree
    for every pattern.

    Args:
        fn: maps (latent values, data) to the factor's arguments (a dict).
        shared: block → the arguments that read it elementwise ("gather").
        point: the probe point (every neighbour block).
        blocks: name → :class:`Block`.
        rng: host random generator.

    Returns:
        a probe whose decision is the set of blocks whose elements the factor couples.
    """
    inputs = {"point": point, "tangents": {}}
    for n in shared:
        b = blocks[n]
        elementwise = not b.family.dense_event
        if elementwise:
            base = np.exp(0.3 * rng.normal(size=b.value_shape))
            signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + b.value_shape)
            inputs["tangents"][n] = np.concatenate([base[None], signs * base])
        else:
            dim = math.prod(b.value_shape) // max(math.prod(b.batch_shape), 1)
            event = rng.normal(size=(dim,))
            signs = rng.choice([-1.0, 1.0], size=(_NUM_SIGN_PATTERNS,) + b.batch_shape + (1,))
            canon = np.concatenate([np.ones((1,) + b.batch_shape + (1,)), signs]) * event
            inputs["tangents"][n] = np.stack([b.to_site(c) for c in canon])

    def compute(inputs, data):
        out = {}
        for n, tangents in inputs["tangents"].items():
            p = inputs["point"]

            def along(t, n=n, p=p):
                return jax.jvp(lambda x: fn({**p, n: x}, data), (p[n],), (t,))[1]

            pushed = jax.vmap(along)(tangents)
            out[n] = {a: pushed[a] for a in shared[n]}
        return out

    def decide(outputs) -> frozenset:
        coupled = set()
        for n, args in outputs.items():
            arrays = [np.asarray(v) for v in args.values()]
            shape = np.broadcast_shapes(*(a.shape for a in arrays))
            arrays = [np.broadcast_to(a, shape) for a in arrays]
            ratios, valid = [], []
            for a in arrays:
                base = a[0]
                ok = np.abs(base) > 1e3 * np.finfo(a.dtype).eps * (np.max(np.abs(base), initial=0.0) + 1e-30)
                ratios.append(np.where(ok, a[1:] / np.where(ok, base, 1.0), 0.0))
                valid.append(ok)
            for i in range(len(arrays)):
                for j in range(i + 1, len(arrays)):
                    both = valid[i] & valid[j]
                    if np.any(both & (np.sign(ratios[i]) != np.sign(ratios[j]))):
                        coupled.add(n)
        return frozenset(coupled)

    return ArgumentProbe("pairing", tuple(shared), inputs, compute, decide)


def _secant_ok(diff, slope) -> bool:
    """f(x1) − f(x0) == J(x0)(x1 − x0), as for every affine map."""
    diff, slope = np.asarray(diff), np.asarray(slope)
    if not (np.all(np.isfinite(diff)) and np.all(np.isfinite(slope))):
        return False
    rtol = 1e-6 if diff.dtype == np.float64 else 1e-3
    scale = 1.0 + (np.abs(diff).max() if diff.size else 0.0)
    return bool(np.allclose(diff, slope, rtol=rtol, atol=rtol * 1e-3 * scale))


def _gather_ok(sq) -> bool:
    sq = np.asarray(sq)
    ref = sq[0]
    tol = 1e-5 if sq.dtype == np.float64 else 1e-3
    return bool(np.all(np.abs(sq - ref) <= tol * (np.abs(ref) + 1e-12)))


def _jvp_squares(fn, point, name, tangents, data):
    def jvp_of(t):
        return jax.jvp(lambda x: fn({**point, name: x}, data), (point[name],), (t,))[1]

    return jnp.square(jax.vmap(jvp_of)(tangents))


def _gaussian_probe(fn, cont, blocks):
    def compute(inputs, data):
        out = []
        for point, tangent, signs in zip(inputs["points"], inputs["tangents"], inputs["signs"]):

            def restricted(x, point=point):
                return fn({**point, **x}, data)

            d2 = _second_derivative(restricted, {n: point[n] for n in cont}, tangent)
            sq = {n: _jvp_squares(fn, point, n, signs[n], data) for n in signs}
            out.append({"d2": d2, "sq": sq, "val": fn(point, data)})
        # secants from the first probe point: exact for affine maps, not across kinks (abs, relu)
        p0 = inputs["points"][0]
        x0 = {n: p0[n] for n in cont}
        secants = []
        for target in inputs["secants"]:
            step = jax.tree.map(lambda a, b: b - a, x0, target)
            f0, slope = jax.jvp(lambda x: fn({**p0, **x}, data), (x0,), (step,))
            secants.append((fn({**p0, **target}, data) - f0, slope))
        out.append({"secant": secants})
        return out

    def decide(outputs):
        full = set()
        if not all(_secant_ok(*sec) for sec in outputs[-1]["secant"]):
            return ArgumentClass("opaque", cont, reason="not affine in its Gaussian blocks")
        for o in outputs[:-1]:
            d2 = np.asarray(o["d2"])
            # exact zeros for linear maps; a link's inverse composed with the link (log∘exp)
            # leaves rounding-level curvature
            tol = (1e-8 if d2.dtype == np.float64 else 1e-4) * (1.0 + np.abs(np.asarray(o["val"])))
            if not bool(np.all(np.abs(d2) <= tol)):
                return ArgumentClass("opaque", cont, reason="not affine in its Gaussian blocks")
            full.update(n for n, sq in o["sq"].items() if not _gather_ok(sq))
        return ArgumentClass("affine_gaussian", cont, tuple(sorted(full)))

    return compute, decide


def _gamma_probe(fn, name, family):
    def compute(inputs, data):
        out = []
        for point, tangent, signs in zip(inputs["points"], inputs["tangents"], inputs["signs"]):

            def log_fn(u, point=point):
                return jnp.log(fn({**point, name: jnp.exp(u[name])}, data))

            u0 = {name: jnp.log(point[name])}
            val = fn(point, data)
            d2 = _second_derivative(log_fn, u0, {name: tangent[name]})
            slope = jax.jvp(log_fn, (u0,), ({name: jnp.ones_like(u0[name])},))[1]
            o = {"val": val, "d2": d2, "slope": slope}
            if name in signs:
                log_point = {**point, name: u0[name]}
                o["sq"] = _jvp_squares(lambda v, d: log_fn({name: v[name]}), log_point, name, signs[name], data)
            out.append(o)
        # secants in log space from the first probe point (catch kinks such as max(τ, 1))
        p0 = inputs["points"][0]

        def log_at(u):
            return jnp.log(fn({**p0, name: jnp.exp(u)}, data))

        u0 = jnp.log(p0[name])
        secants = []
        for target in inputs["secants"]:
            u1 = jnp.log(target[name])
            g0, slope = jax.jvp(log_at, (u0,), (u1 - u0,))
            secants.append((log_at(u1) - g0, slope))
        out.append({"secant": secants})
        return out

    def decide(outputs):
        if not all(_secant_ok(*sec) for sec in outputs[-1]["secant"]):
            return ArgumentClass("opaque", (name,), reason="not a power of its Gamma block")
        for o in outputs[:-1]:
            val = np.asarray(o["val"])
            if not np.all(val > 0):
                return ArgumentClass("opaque", (name,), reason="not positive")
            if not np.all(np.abs(np.asarray(o["d2"])) <= 1e-6 * (1 + np.abs(val))):
                return ArgumentClass("opaque", (name,), reason="not a power of its Gamma block")
            if "sq" in o and not _gather_ok(o["sq"]):
                return ArgumentClass("opaque", (name,), reason="mixes elements of its Gamma block")
        slope = np.asarray(outputs[0]["slope"]).ravel()
        power = float(slope[0]) if slope.size and np.allclose(slope, slope[0], rtol=1e-6, atol=1e-9) else None
        return ArgumentClass("power_gamma", (name,), power=block_power(family, power))

    return compute, decide


def _identity_probe(fn, name, family):
    def compute(inputs, data):
        out = []
        for point, signs in zip(inputs["points"], inputs["signs"]):
            x = point[name]

            def lin_fn(v, point=point):
                return fn({**point, name: v}, data)

            val, slope_x = jax.jvp(lin_fn, (x,), (x,))
            _, slope_1 = jax.jvp(lin_fn, (x,), (jnp.ones_like(x),))
            o = {"val": val, "slope_x": slope_x, "slope_1": slope_1}
            if name in signs:
                o["sq"] = _jvp_squares(fn, point, name, signs[name], data)
            if "whole" in inputs:
                o["whole"] = _jvp_squares(fn, point, name, inputs["whole"], data)
            out.append(o)
        return out

    def decide(outputs):
        for o in outputs:
            # (a whole-event family reads c Λ too: its moments carry the constant)
            ok = np.allclose(o["val"], o["slope_x"], rtol=1e-6, atol=1e-9) and (
                family.whole_events or np.allclose(o["slope_1"], 1.0, rtol=1e-6)
            )
            if not ok:
                return ArgumentClass("opaque", (name,), reason=f"not the {family.name} block itself")
            if "whole" in o and not _whole_ok(o["whole"], family.dim):
                return ArgumentClass("opaque", (name,), reason=f"reads parts of its {family.name} matrices")
            if "sq" in o and not _gather_ok(o["sq"]):
                return ArgumentClass("opaque", (name,), reason=f"mixes elements of its {family.name} block")
        return ArgumentClass(family.argument_kind, (name,))

    return compute, decide


def run_probes(probes: dict, data) -> dict:
    """Run the probes of many arguments in one compiled call and classify each.

    Args:
        probes: key → :class:`ArgumentProbe`.
        data: dynamic model data.

    Returns:
        key → :class:`ArgumentClass`.
    """
    # positions as keys inside jit: probe keys mix names, ints and "value" (not sortable)
    active = [(k, p) for k, p in probes.items() if p.compute is not None]

    def compute_all(inputs, data):
        return [p.compute(x, data) for (_, p), x in zip(active, inputs)]

    outputs = {}
    if active:
        inputs = [p.inputs for _, p in active]
        compiled = compile_lowered(_jit(compute_all).lower(inputs, data), compiler_options(data))
        outputs = {k: out for (k, _), out in zip(active, compiled(inputs, data))}
    return {k: p.decide(outputs.get(k)) for k, p in probes.items()}
