"""``scan`` s whose carries are known ahead, evaluated as maps over the steps.

A model written with ``scan`` (NumPyro's ``contrib.control_flow.scan``: one site per step of
a time series, a hidden Markov chain) is, once every latent's value is substituted, a loop
whose steps do not need each other: the user's carry is the value of a site (read from the
substituted values at the step's index), and the only true recurrence left is the step
counter (and, in a seeded model, a PRNG key). Evaluated as written, each of a fit's many
evaluations of the model (every factor's expectation, its gradient, the ELBO, the
diagnostics' draws) runs a loop of T small steps, with a dynamic slice and update per site
and step; as a map over the steps it is a few array operations of length T.

For a ``scan`` with carries c, inputs x_t and body (c_{t+1}, y_t) = f(c_t, x_t):

* the carries are split by the body's data flow (:func:`blrppl.model.deps`): the
  *recurrent* ones R are those on a cycle of "carry k's next value reads carry j" and
  every carry they read; the others are computed from R's and the inputs, in order of that
  (acyclic) dependency;
* R's sequence c^R_0 … c^R_{T−1} comes from a scan of the body pruned to R (a counter
  ``i + 1`` from an ``arange``, no loop at all);
* each other carry's sequence is the body pruned to that carry, mapped (``vmap``) over the
  steps with the sequences known so far; the outputs y_t are the body pruned to them, mapped
  over the steps with every carry's sequence.

The result is the scan's, operation for operation (each step's arithmetic is the same; only
the loop is gone). A scan is kept as written when its recurrent part is most of its body (a
deterministic recurrence: mapping would add work), when its body has effects, or when it has
no steps.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from blrppl.model.deps import _jaxpr_deps

#: a scan is mapped only when its recurrent part has at most this fraction of its body's
#: equations (a counter and a key: a handful of a body's dozens)
RECURRENT_SHARE = 0.5


def _dce(jaxpr, used_outputs):
    from jax._src.interpreters import partial_eval as pe

    return pe.dce_jaxpr(jaxpr, list(used_outputs))


def subjaxprs(eqn):
    """The jaxprs an equation's parameters hold (a call's, a scan's body, a cond's
    branches)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jex_core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jex_core.Jaxpr):
                yield v


def _has_scan(jaxpr) -> bool:
    return any(eqn.primitive.name == "scan" or any(_has_scan(sub) for sub in subjaxprs(eqn)) for eqn in jaxpr.eqns)


def vectorise(jaxpr, consts):
    """``(jaxpr, consts)`` with its mappable scans (module docstring) evaluated as maps over
    their steps: a new ``(jaxpr, consts)`` computing the same outputs, or the same pair when
    the program has no scan."""
    if not _has_scan(jaxpr):
        return jaxpr, consts
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]
    closed = jax.make_jaxpr(lambda *args: evaluate(jaxpr, consts, *args))(*avals)
    return closed.jaxpr, closed.consts


def evaluate(jaxpr, consts, *args):
    """``jax.core.eval_jaxpr`` with every mappable scan (also inside ``pjit`` calls) evaluated
    as a map over its steps."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = None
        if eqn.primitive.name == "scan":
            outs = _scan_as_map(eqn, invals)
        elif eqn.primitive.name in ("pjit", "jit") and _has_scan(eqn.params["jaxpr"].jaxpr):
            sub = eqn.params["jaxpr"]
            outs = evaluate(sub.jaxpr, sub.consts, *invals)
        if outs is None:
            bind = eqn.primitive.get_bind_params(eqn.params)  # (older jax: (subfuns, params))
            subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
            ctx = getattr(eqn, "ctx", None)
            with ctx.manager if ctx is not None else contextlib.nullcontext():
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _counter_step(body, carry_index: int):
    """The increment c of a body pruned to one carry whose next value is ``carry + c`` (a
    literal integer), else None."""
    if len(body.eqns) != 1 or len(body.outvars) != 1:
        return None
    (eqn,) = body.eqns
    if eqn.primitive.name != "add" or eqn.outvars[0] is not body.outvars[0]:
        return None
    carry = body.invars[carry_index]
    a, b = eqn.invars
    other = b if a is carry else a if b is carry else None
    if not isinstance(other, jex_core.Literal) or not jnp.issubdtype(carry.aval.dtype, jnp.integer):
        return None
    return other.val


def _scan_as_map(eqn, invals):
    """The outputs of the ``scan`` equation ``eqn`` at ``invals`` computed as maps over its
    steps (module docstring), or None to evaluate it as written."""
    p = eqn.params
    body, n_consts, n_carry, length, reverse = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"], p["reverse"]
    jaxpr = body.jaxpr
    n_in, n_out = len(jaxpr.invars), len(jaxpr.outvars)
    if length == 0 or jaxpr.effects or n_carry == 0 and n_out == 0:
        return None
    consts, init, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]
    deps = _jaxpr_deps(jaxpr, [frozenset({i}) for i in range(n_in)])
    # carry j's next value reads the carries reads[j]
    reads = [{k - n_consts for k in deps[j] if n_consts <= k < n_consts + n_carry} for j in range(n_carry)]
    # recurrent: on a cycle, and everything they read (reach: the transitive closure of reads)
    reach = [set(r) for r in reads]
    for _ in range(n_carry):
        reach = [r.union(*(reach[k] for k in r)) for r in reach]
    recurrent = {j for j in range(n_carry) if j in reach[j]}
    recurrent = recurrent.union(*(reach[j] for j in recurrent))
    free = [j for j in range(n_carry) if j not in recurrent]
    if not free and n_out == n_carry:
        return None
    rec = sorted(recurrent)
    rec_body, rec_used = _dce(jaxpr, [j in recurrent for j in range(n_carry)] + [False] * (n_out - n_carry))
    if rec and len(rec_body.eqns) > RECURRENT_SHARE * len(jaxpr.eqns):
        return None

    def flip(x):
        return jnp.flip(x, 0) if reverse else x

    xs_steps = [flip(x) for x in xs]  # in the order the scan visits them
    body_consts = body.consts
    seq = {}  # carry j → its value at every step, (length, ...)
    last = {}
    if rec:
        # (the pruned body keeps only the inputs it reads: the carry's position among them)
        at = n_consts + rec[0]
        step = _counter_step(rec_body, sum(rec_used[:at])) if len(rec) == 1 and rec_used[at] else None
        if step is not None:
            (j,) = rec
            c0 = jnp.asarray(init[j])
            seq[j] = c0 + jnp.asarray(step, c0.dtype) * jnp.arange(length, dtype=c0.dtype)
            last[j] = c0 + jnp.asarray(step, c0.dtype) * jnp.asarray(length, c0.dtype)
        else:
            used_consts = [x for x, u in zip(consts, rec_used[:n_consts]) if u]
            rec_used_carry = rec_used[n_consts : n_consts + n_carry]
            used_xs = rec_used[n_consts + n_carry :]

            def rec_step(carry, x):
                full = dict(zip(rec, carry))
                args = used_consts + [full[j] for j in range(n_carry) if rec_used_carry[j]]
                args += [v for v, u in zip(x, used_xs) if u]
                new = evaluate(rec_body, body_consts, *args)
                return new, carry

            final, history = jax.lax.scan(rec_step, [init[j] for j in rec], xs_steps, length=length)
            for j, f, h in zip(rec, final, history):
                seq[j], last[j] = h, f

    def mapped(outputs):
        """The body pruned to ``outputs`` (indices of its outputs), mapped over the steps
        with the carry sequences known in ``seq``."""
        pruned, used = _dce(jaxpr, [i in outputs for i in range(n_out)])
        used_consts = [x for x, u in zip(consts, used[:n_consts]) if u]
        carries = [j for j in range(n_carry) if used[n_consts + j]]
        steps = [seq[j] for j in carries] + [x for x, u in zip(xs_steps, used[n_consts + n_carry :]) if u]
        if not steps:  # (reads neither a carry nor an input: the same at every step)
            outs = evaluate(pruned, body_consts, *used_consts)
            return [jnp.broadcast_to(o, (length,) + jnp.shape(o)) for o in outs]
        return jax.vmap(lambda *s: evaluate(pruned, body_consts, *used_consts, *s))(*steps)

    pending = list(free)
    while pending:
        ready = [j for j in pending if reads[j] <= set(seq)]
        if not ready:
            return None  # (cannot happen: the free carries' dependencies are acyclic)
        for j, out in zip(ready, mapped(set(ready))):
            seq[j] = jnp.concatenate([jnp.asarray(init[j], out.dtype)[None], out[:-1]], 0)
            last[j] = out[-1]
        pending = [j for j in pending if j not in ready]
    ys = mapped(set(range(n_carry, n_out))) if n_out > n_carry else []
    return [last[j] for j in range(n_carry)] + [flip(y) for y in ys]
