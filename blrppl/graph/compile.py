"""Compiling a traced model into blocks, a factor graph and a static plan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
from numpyro.distributions import constraints

from blrppl import families as fam
from blrppl.errors import FamilyError, UnsupportedFactorError, UnsupportedLatentError
from blrppl.expressions import ModelFunctions, probe_argument, run_probes
from blrppl.graph.deps import output_dependencies
from blrppl.graph.plan import Block, Factor, Plan
from blrppl.graph.trace import SiteRecord, finite_support_values
from blrppl.rules import find_rule

#: families a user may ask for, by the support they fit
_FITS = {
    "gaussian": "real",
    "gaussian-diag": "real",
    "gamma": "positive",
    "beta": "unit_interval",
    "dirichlet": "simplex",
    "categorical": "discrete",
    "bernoulli": "discrete",
}


def _support_kind(support) -> str:
    base = support
    while isinstance(base, constraints.independent):
        base = base.base_constraint
    if base.is_discrete:
        return "discrete"
    if base is constraints.real or base is constraints.real_vector:
        return "real"
    if base is constraints.positive:
        return "positive"
    if base is constraints.unit_interval:
        return "unit_interval"
    if base is constraints.simplex:
        return "simplex"
    return str(base)


def choose_family(record: SiteRecord, override: str | None) -> Block:
    """The candidate family of a latent site (native conjugate family by support)."""
    kind = _support_kind(record.support)
    shape = record.value_shape
    if kind == "discrete":
        values = finite_support_values(record.support)
        if values is None:  # checked at trace time already
            raise UnsupportedLatentError("unbounded discrete support", site=record.name)
        name = override or ("bernoulli" if len(values) == 2 and values[0] == 0 else "categorical")
        if name not in ("categorical", "bernoulli") or (name == "bernoulli" and len(values) != 2):
            raise FamilyError(
                f"family '{name}' cannot represent a discrete latent with {len(values)} values; "
                "use 'categorical'",
                site=record.name,
            )
        family = fam.Bernoulli() if name == "bernoulli" else fam.Categorical(len(values))
        return Block(record.name, family, name, shape, (), tuple(int(v) for v in values))
    native = {"real": "gaussian", "positive": "gamma", "unit_interval": "beta", "simplex": "dirichlet"}
    name = override or native.get(kind)
    if name is None:
        raise UnsupportedLatentError(
            f"latent with support {record.support} has no candidate family; supported supports "
            "are real, positive, unit interval, simplex and finite discrete",
            site=record.name,
        )
    if name not in _FITS or _FITS[name] != kind:
        fits = sorted(k for k, v in _FITS.items() if v == kind)
        raise FamilyError(
            f"family '{name}' cannot represent a latent with support {record.support}; "
            f"families that fit it: {fits}",
            site=record.name,
        )
    if name == "gaussian":
        axes = record.plate_axes()
        dim = int(np.prod([s for a, s in enumerate(shape) if a not in axes]))
        return Block(record.name, fam.GaussianDense(dim), name, shape, axes)
    if name == "gaussian-diag":
        return Block(record.name, fam.GaussianDiag(), name, shape)
    if name == "gamma":
        return Block(record.name, fam.Gamma(), name, shape)
    if name == "beta":
        return Block(record.name, fam.Beta(), name, shape)
    return Block(record.name, fam.Dirichlet(shape[-1]), name, shape)


def init_nat(block: Block, init_value, probs=None):
    """Initial natural parameters: centred on the initial value, broad; discrete blocks
    start from the given random ``probs`` (breaking the symmetry of mixtures)."""
    family = block.family
    x = jnp.asarray(init_value)
    dtype = jnp.result_type(float)
    if block.discrete:
        return family.nat_from_view(fam.CategoricalView(jnp.asarray(probs, dtype)))
    x = x.astype(dtype)
    if block.kind == "gaussian":
        mean = block.to_canonical(x)
        dim = mean.shape[-1]
        cov = jnp.broadcast_to(jnp.eye(dim, dtype=dtype), mean.shape + (dim,))
        return family.nat_from_view(fam.GaussianView(mean, cov))
    if block.kind == "gaussian-diag":
        return family.nat_from_view(fam.DiagGaussianView(x, jnp.ones_like(x)))
    if block.kind == "gamma":
        return family.nat_from_view(fam.GammaView(jnp.full_like(x, 10.0), 10.0 / x))
    if block.kind == "beta":
        return family.nat_from_view(fam.BetaView(2.0 * x + 0.5, 2.0 * (1.0 - x) + 0.5))
    return family.nat_from_view(fam.DirichletView(x * x.shape[-1] + 0.5))


def compile_model(model, records, data_spec, data, families=None, rng_key=None):
    """Build blocks, the factor graph and the plan of a traced model.

    Args:
        model: the numpyro model.
        records: site records from :func:`blrppl.graph.trace.trace_model`.
        data_spec, data: the model's data (static part and array leaves).
        families: optional dict site → family name overriding the default.
        rng_key: key for the probes.

    Returns:
        (plan, model functions, dynamic data leaves, init values dict, networkx graph)
    """
    families = dict(families or {})
    for name in families:
        if name not in records or records[name].observed:
            raise FamilyError(
                f"families= names '{name}', which is not a latent sample site of the model",
                site=name,
            )
    rng_key = jax.random.key(1) if rng_key is None else rng_key
    latent = [r for r in records.values() if not r.observed]
    blocks = {r.name: choose_family(r, families.get(r.name)) for r in latent}
    init_values = {r.name: jnp.asarray(r.init_value) for r in latent}
    fns = ModelFunctions(model, data_spec, init_values)

    # rule of each factor and the arguments it reads
    rules = {}
    for r in records.values():
        rule = None if r.is_factor else find_rule(r.dist_type)
        if rule is None:
            raise UnsupportedFactorError(
                f"no closed-form expected log-density for {r.dist_name} "
                "(this engine fits models whose factors all have one)",
                site=r.name,
            )
        rules[r.name] = rule

    def all_args(values, data):
        out = {}
        for name, rule in rules.items():
            out[name] = fns.factor_args(name, rule.arg_names, values, data)
        return out

    deps = output_dependencies(all_args, init_values, data)

    graph = nx.Graph()
    for name, b in blocks.items():
        graph.add_node(("block", name), kind=b.kind, shape=b.value_shape)
    rng = np.random.default_rng(np.asarray(jax.random.key_data(rng_key)).ravel())
    probes, nbrs = {}, {}
    for name, r in records.items():
        rule = rules[name]
        arg_deps = deps[name]
        neighbours = tuple(n for n in blocks if any(n in d for d in arg_deps.values()))
        discrete = tuple(n for n in neighbours if blocks[n].discrete)
        for d in discrete:
            _check_aligned(r, records[d], name)
        nbrs[name] = (neighbours, discrete)
        for arg in ("value",) + rule.arg_names:

            def fn(values, data, arg=arg, name=name, rule=rule):
                return fns.factor_args(name, rule.arg_names, values, data)[arg]

            probes[(name, arg)] = probe_argument(fn, arg_deps[arg], blocks, rng)
    classes = run_probes(probes, data)

    factors = []
    for name, r in records.items():
        rule = rules[name]
        neighbours, discrete = nbrs[name]
        kinds, arg_blocks, full = [], [], set()
        for arg in ("value",) + rule.arg_names:
            cls = classes[(name, arg)]
            if cls.kind == "opaque":
                raise UnsupportedFactorError(
                    f"argument '{arg}' of {r.dist_name} is not a supported function of the "
                    f"latents {sorted(cls.blocks)} ({cls.reason}); closed-form expectations need "
                    "constants, affine functions of Gaussian latents, powers of Gamma latents, "
                    "or Beta/Dirichlet latents themselves",
                    site=name,
                )
            kinds.append((arg, cls.kind))
            arg_blocks.append((arg, cls.blocks))
            full.update(cls.full)
        if not rule.supports(dict(kinds)):
            desc = ", ".join(f"{a}={k}" for a, k in kinds)
            raise UnsupportedFactorError(
                f"{r.dist_name} has no closed-form expected log-density for arguments of kinds "
                f"({desc})",
                site=name,
            )
        gauss = [n for n in neighbours if blocks[n].kind in ("gaussian", "gaussian-diag")]
        columns = tuple((n, "full" if n in full else "gather") for n in gauss)
        factor = Factor(
            name=name,
            dist_name=r.dist_name,
            observed=r.observed,
            neighbours=neighbours,
            discrete=discrete,
            estimator="exact",
            rule=rule,
            arg_kinds=tuple(kinds),
            arg_blocks=tuple(arg_blocks),
            columns=columns,
            reinterpreted_ndim=r.reinterpreted_ndim,
        )
        factors.append(factor)
        graph.add_node(("factor", name), dist=r.dist_name, estimator="exact")
        for n in neighbours:
            graph.add_edge(("factor", name), ("block", n))

    order = tuple(n for n in blocks if not blocks[n].discrete) + tuple(
        n for n in blocks if blocks[n].discrete
    )
    plan = Plan(blocks=tuple(blocks.values()), factors=tuple(factors), order=order)
    return plan, fns, data, init_values, graph


def _check_aligned(factor: SiteRecord, discrete: SiteRecord, name: str):
    """A discrete block can be enumerated for a factor when each element of the factor uses
    the aligned element of the block: the block's plates are among the factor's."""
    fplates = {p.name for p in factor.plates}
    missing = [p.name for p in discrete.plates if p.name not in fplates]
    batch = factor.value_shape[: len(factor.value_shape) - factor.event_ndim]
    try:
        np.broadcast_shapes(tuple(discrete.value_shape), tuple(batch))
        broadcastable = len(discrete.value_shape) <= len(batch) or not discrete.value_shape
    except ValueError:
        broadcastable = False
    if missing or not broadcastable:
        raise UnsupportedFactorError(
            f"factor depends on the discrete latent '{discrete.name}' across its plate(s) "
            f"{missing or [p.name for p in discrete.plates]}; enumeration needs the factor inside "
            "every plate of the discrete latent, using one element of it per element",
            site=name,
        )
