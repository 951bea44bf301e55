"""Which inputs each output of a function depends on, read off its jaxpr (and, with
:func:`output_forms`, the form of each output: :mod:`blrppl.model.forms`).

Used to find the latent sites each factor's arguments depend on. The analysis is
structural (data flow through the jaxpr's equations), so it works for discrete inputs
and never samples the model. Sub-jaxprs of call-like primitives (``pjit``, custom
derivatives) are followed, ``scan`` bodies to a fixed point of their carries; other
higher-order primitives are treated conservatively (every output depends on every input).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.extend import core as jex_core

from blrppl.model.forms import Const, jaxpr_forms


def _jaxpr_deps(jaxpr, in_deps: Sequence[frozenset], seen: set | None = None) -> list[frozenset]:
    env: dict = {}
    for var, dep in zip(jaxpr.invars, in_deps):
        env[var] = dep
    for var in jaxpr.constvars:
        env[var] = frozenset()

    def read(v):
        if isinstance(v, jex_core.Literal):
            return frozenset()
        return env.get(v, frozenset())

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = sub_jaxpr(eqn)
        sub = sub[0] if sub is not None else None
        if seen is not None:
            seen.add(eqn.primitive.name)
        if eqn.primitive.name == "scan" and sub is not None and len(sub.invars) == len(ins):
            outs = _scan_deps(eqn, sub, ins, seen)
        elif sub is not None and len(sub.invars) == len(ins):
            outs = _jaxpr_deps(sub, ins, seen)
        else:
            union = frozenset().union(*ins) if ins else frozenset()
            outs = [union] * len(eqn.outvars)
        for var, dep in zip(eqn.outvars, outs):
            env[var] = dep
    return [read(v) for v in jaxpr.outvars]


def _scan_deps(eqn, body, ins, seen=None) -> list:
    """A scan's outputs: its body iterated on the dependencies until the carries stop growing
    (a latent may enter the carry at one iteration and reach the outputs only at the next:
    ``level = level + a`` with ``y_t ~ Normal(level, ...)`` sampled before the update)."""
    num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = ins[:num_consts], list(ins[num_consts : num_consts + num_carry]), ins[num_consts + num_carry :]
    while True:
        outs = _jaxpr_deps(body, consts + carry + xs, seen)
        grown = [c | o for c, o in zip(carry, outs[:num_carry])]
        if grown == carry:
            return grown + outs[num_carry:]
        carry = grown


def sub_jaxpr(eqn):
    """``(jaxpr, consts)`` of a call-like equation's body (``pjit``, custom derivatives, a
    ``scan``'s body), or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is None:
            continue
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
            return inner, tuple(getattr(sub, "consts", ()))
    return None


class TracedProgram(NamedTuple):
    """A function's jaxpr as the analyses read it.

    Attributes:
        jaxpr: the closed jaxpr of ``fn(inputs, *extra)``.
        names: per flat input, the ``inputs`` entry it belongs to (None for ``extra`` leaves).
        extra: the ``extra`` leaves (data), in the jaxpr's input order.
        treedef: the structure of ``fn``'s output.
        cache: what the analyses derive from it once (a dict).
    """

    jaxpr: Any
    names: list
    extra: list
    treedef: Any
    cache: dict


def output_forms(fn: Callable, inputs: dict, input_forms: dict, *extra) -> tuple:
    """The dependencies and the forms (:mod:`blrppl.model.forms`) of every leaf of
    ``fn(inputs, *extra)``, from one jaxpr, and the primitives the program uses.

    Args:
        fn, inputs, extra: as for :func:`output_dependencies`.
        input_forms: name → the form of every leaf of ``inputs[name]`` (the ``extra``
            arguments are constants).

    Returns:
        ``(dependencies, forms, primitives, program)``: two pytrees with the structure of
        ``fn``'s output (frozensets of names; forms), a set of primitive names, and the
        :class:`TracedProgram` they were read from (for :mod:`blrppl.model.elements`).
    """
    closed, treedef, names = _trace(fn, inputs, extra)
    primitives: set = set()
    out_deps = _jaxpr_deps(closed.jaxpr, [frozenset([n]) if n else frozenset() for n in names], primitives)
    in_forms = [input_forms[n] if n else Const() for n in names]
    out_forms, _ = jaxpr_forms(closed.jaxpr, in_forms, closed.consts)
    program = TracedProgram(closed, names, jax.tree.leaves(extra), treedef, {})
    return jax.tree.unflatten(treedef, out_deps), jax.tree.unflatten(treedef, out_forms), primitives, program


def _trace(fn, inputs: dict, extra: tuple) -> tuple:
    """The closed jaxpr of ``fn(inputs, *extra)``, its output structure, and the name of the
    ``inputs`` entry behind each flat input (None for the ``extra`` leaves)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(inputs, *extra)
    # make_jaxpr flattens (inputs, *extra) in pytree order: dict keys are sorted
    names = [name for name in sorted(inputs) for _ in jax.tree.leaves(inputs[name])]
    names += [None] * len(jax.tree.leaves(extra))
    return closed, jax.tree.structure(out_shape), names


def output_dependencies(fn: Callable, inputs: dict, *extra, primitives: set | None = None) -> dict:
    """For each leaf of ``fn(inputs, *extra)``, the set of ``inputs`` keys it depends on.

    Args:
        fn: a function of a dict of arrays (and optional extra arguments, which are
            treated as having no tracked dependencies).
        inputs: dict name → array (or pytree); dependencies are reported by name.
        primitives: if given, filled with the names of the primitives the program uses.

    Returns:
        A pytree with the structure of ``fn``'s output whose leaves are frozensets of names.
    """
    closed, treedef, names = _trace(fn, inputs, extra)
    out_deps = _jaxpr_deps(closed.jaxpr, [frozenset([n]) if n else frozenset() for n in names], primitives)
    return jax.tree.unflatten(treedef, out_deps)
