"""The fingerprint of a traced program: the key of its compiled fits, in this process and in
the program store across processes.

It hashes what the program's printed equations show (each equation's primitive, its
parameters, its variables numbered in order of appearance with their types, sub-programs
recursively) and the bytes of every constant and literal, written straight into the hash
equation by equation. Printing the whole program first (``str(jaxpr)``, JAX's
pretty-printer) took most of the fingerprint's time and grew with the program: a model
written with one site per step of a Python loop holds tens of equations per site.
"""

from __future__ import annotations

import hashlib
import re

import jax
import numpy as np
from jax.extend import core as jex_core

#: a parameter's printed object address, which differs from process to process
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def program_fingerprint(closed_jaxpr, extra: str = "") -> str:
    """A hash of a traced program: its equations (primitives, parameters, variables and their
    types), the bytes of every constant and literal it holds (sub-programs included), and
    ``extra`` (what the program reads outside its operations)."""
    digest = hashlib.blake2b(digest_size=20)
    digest.update(extra.encode())
    writer = _Writer(digest)
    for c in closed_jaxpr.consts:
        if jax.dtypes.issubdtype(getattr(c, "dtype", np.float64), jax.dtypes.prng_key):
            c = jax.random.key_data(c)
        writer.value(c)
    writer.jaxpr(closed_jaxpr.jaxpr)
    return digest.hexdigest()


class _Writer:
    """Writes a program's structure into a hash (see the module docstring)."""

    def __init__(self, digest):
        self.digest = digest
        self.names: dict = {}
        self.types: dict = {}

    def value(self, value) -> None:
        """A constant's or literal's dtype, shape and bytes."""
        arr = np.asarray(value)
        self.digest.update(f"{arr.dtype}{arr.shape}".encode())
        self.digest.update(arr.tobytes() if arr.dtype != object else repr(value).encode())

    def variables(self, variables) -> str:
        """Variables as their numbers in order of appearance and their types; literals by
        their value (written into the hash)."""
        out = []
        for v in variables:
            if isinstance(v, jex_core.Literal):
                self.value(v.val)
                out.append(f"L{self._type(v.aval)}")
                continue
            number = self.names.get(v)
            if number is None:
                number = self.names[v] = len(self.names)
            out.append(f"{number}:{self._type(v.aval)}")
        return " ".join(out)

    def _type(self, aval) -> str:
        try:
            text = self.types.get(aval)
        except TypeError:  # (an unhashable type)
            return str(aval)
        if text is None:
            text = self.types[aval] = str(aval)
        return text

    def jaxpr(self, jaxpr) -> None:
        """A program: its binders, equations and outputs."""
        update = self.digest.update
        update(f"{{{self.variables(jaxpr.constvars)};{self.variables(jaxpr.invars)}.".encode())
        for eqn in jaxpr.eqns:
            update(f"{self.variables(eqn.outvars)}={eqn.primitive.name}[".encode())
            for name in sorted(eqn.params):
                update(f"{name}=".encode())
                self.parameter(eqn.params[name])
            update(f"]{self.variables(eqn.invars)};".encode())
        update(f"in {self.variables(jaxpr.outvars)}}}".encode())

    def parameter(self, param) -> None:
        """A parameter: sub-programs written as programs (their constants' bytes too), other
        values as printed (object addresses masked, sets sorted)."""
        subs = param if isinstance(param, (tuple, list)) else (param,)
        if subs and all(hasattr(getattr(s, "jaxpr", s), "eqns") for s in subs):
            for sub in subs:
                for c in getattr(sub, "consts", ()):
                    self.value(c)
                self.jaxpr(getattr(sub, "jaxpr", sub))
            return
        text = _user_function(param)
        if isinstance(param, frozenset):
            text = f"frozenset({{{', '.join(repr(e) for e in sorted(param, key=repr))}}})"
        elif text is None:
            text = _ADDRESS.sub(" at 0x", str(param))
        self.digest.update(f"{text},".encode())


def _user_function(param) -> str | None:
    """The identity of a user's function that a parameter wraps (a ``jax.custom_vjp`` rule's
    backward pass: JAX's wrapper of it prints only its name, ``<lambda>`` for most; the
    function of a ``jax.pure_callback`` or ``io_callback``, printed with its address), or None
    for any other parameter. Two functions of the same name are other functions, and a
    compiled fit of one must not serve the other (a rule JAX cannot differentiate twice was
    fitted with the rule of a model traced before it; a callback closing over another value
    would have run the first one's): the identity is the function object's in this process
    (the fingerprint of such a model differs from process to process, and its fits are
    compiled again in each). JAX's own functions (the memoized thunks it wraps around every
    rule) are left to their printed form."""
    core = getattr(param, "f", None) if hasattr(param, "transforms") else getattr(param, "callback_func", None)
    if core is None or not callable(core):
        return None
    module = getattr(core, "__module__", None) or ""
    if module == "jax" or module.startswith(("jax.", "jaxlib")):
        return None
    return f"{module}.{getattr(core, '__qualname__', type(core).__name__)}@{id(core)}"
