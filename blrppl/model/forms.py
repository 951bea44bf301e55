"""The form of every distribution argument as a function of the latent sites, read off the
model's jaxpr (no numerical probing).

One abstract interpretation of the program that computes every factor's arguments from the
latent site values (the jaxpr :mod:`blrppl.model.deps` reads) assigns each variable a
**form**, propagated primitive by primitive:

* :class:`Const` — depends on no continuous latent (data, literals, enumerated discrete
  latents: their values are indices the enumeration fixes);
* :class:`Affine` — an affine function of the values of ``sites`` with constant coefficients
  (``X @ w + b``, ``a[group]``, sums, slices, ``select_n`` with a constant predicate);
  ``mixes`` says whether an element may combine several elements of one site (a sum, a
  contraction, a cumulative sum), which the elementwise moments of plated blocks forbid;
* :class:`Power` — c · x^a elementwise in one site x, with a constant c and a known scalar
  exponent a (``1 / jnp.sqrt(tau)``, ``tau ** 2``); ``unit`` when c = 1 (the site itself,
  possibly indexed);
* :class:`LogPower` — log(c · x^a) = a log x + log c: affine in log x (a positive latent
  fitted on log space: its log is affine in the Gaussian block);
* :class:`Product` — c · Π x_i^(a_i) over several sites (``tau * lambdas``), and
  :class:`LogProduct` its log (affine in the sites' logs);
* :class:`Choice` — each element a power of one of several sites
  (``jnp.where(t < tau, early, late)``);
* :class:`Logit` — the logit of a site itself;
* :class:`Linked` — exp or sigmoid of an affine form (a GLM's inverse link);
* :class:`Opaque` — anything else, with the reason (the primitive that made it so).

Forms are in terms of *site* values. :func:`blrppl.model.classes.classify_form` turns a form
into the argument class of :mod:`blrppl.model.classes` once the blocks are known (a site fitted by a Gaussian on
log space reads ``LogPower`` as affine and ``Power`` as the exp of an affine form); where a
form mixes the elements of a plated block, which elements each element reads is read off the
same program by :mod:`blrppl.model.elements`.

Control flow: ``pjit`` and custom-derivative calls are followed into their bodies, ``cond``
joins its branches, ``scan`` and ``while`` iterate their bodies on the carries to a fixed
point. A primitive without a rule gives :class:`Opaque` when a latent reaches it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
from jax.extend import core as jex_core


@dataclasses.dataclass(frozen=True)
class Const:
    """No continuous latent; ``value`` a host scalar when known (literals, their arithmetic)."""

    value: float | None = None


@dataclasses.dataclass(frozen=True)
class Affine:
    """An affine function of the values of ``sites`` with constant coefficients; ``mixes``:
    an element may combine several elements of one site."""

    sites: frozenset
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Power:
    """c · x^a elementwise in one site x (a known scalar a); ``unit``: c = 1."""

    site: str
    power: float
    unit: bool = True
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class LogPower:
    """log(c · x^a) = a log x + log c in one site x."""

    site: str
    power: float | None  # None: a coefficient not known at compile time
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Linked:
    """exp or sigmoid of an affine form in ``sites``."""

    link: str  # "exp" | "sigmoid"
    sites: frozenset
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Product:
    """c · Π_i x_i^(a_i) over several sites (``tau * lambdas``); ``terms`` holds (site, a)."""

    terms: frozenset
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    """Each element c · x^a for one of the (site, a) of ``terms`` (a selection between the
    powers of several sites: ``jnp.where(t < tau, early, late)``)."""

    terms: frozenset
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class LogProduct:
    """An affine combination of the logs of several sites (log of a :class:`Product`)."""

    sites: frozenset
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Logit:
    """logit(x) of a site's value itself (affine in a block on logit space)."""

    site: str
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Bilinear:
    """u(x_left) · v(x_right) + w(x_affine) elementwise (or summed over such products with
    ``mixes``): u, v, w affine with constant coefficients, the sites of u and of v disjoint
    (``w * x``, ``phi * (h_prev - mu) + mu``, ``a[i] * b[j]``, ``X @ C.T``). Affine in the
    left sites given the right ones and the other way round."""

    left: frozenset
    right: frozenset
    affine: frozenset = frozenset()
    mixes: bool = False


@dataclasses.dataclass(frozen=True)
class Opaque:
    """Anything else; ``reason`` names what made it so."""

    reason: str


Form = Const | Affine | Power | Product | Choice | LogPower | LogProduct | Logit | Linked | Bilinear | Opaque

#: primitives that pass each element through unchanged in value (layout only)
_LAYOUT = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice", "rev", "copy",
    "copy_p", "reduce_precision", "optimization_barrier", "split",
})
#: primitives whose last operands are indices: the form of the first operand, provided the
#: indices are constant
_INDEXED = frozenset({"gather", "dynamic_slice"})
#: primitives whose rules compute known scalar constants (every other primitive of constants
#: is a constant of unknown value)
_CONST_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "neg", "integer_pow", "square", "sqrt", "rsqrt", "pow", "exp", "log", "convert_element_type"}) | _LAYOUT


def sites_of(form) -> frozenset:
    """The latent sites a form depends on."""
    if isinstance(form, Affine | Linked | LogProduct):
        return form.sites
    if isinstance(form, Product | Choice):
        return frozenset(site for site, _ in form.terms)
    if isinstance(form, Power | LogPower | Logit):
        return frozenset([form.site])
    if isinstance(form, Bilinear):
        return form.left | form.right | form.affine
    return frozenset()


def mixes(form) -> bool:
    """Whether an element of the form may combine several elements of one site."""
    return bool(getattr(form, "mixes", False))


def _as_affine(form):
    """A form as an affine one, if it is: constants and the first power of a site are."""
    if isinstance(form, Const):
        return Affine(frozenset())
    if isinstance(form, Affine):
        return form
    if isinstance(form, Power) and form.power == 1.0:
        return Affine(frozenset([form.site]), form.mixes)
    if isinstance(form, Choice) and all(a == 1.0 for _, a in form.terms):
        return Affine(sites_of(form), form.mixes)
    return None


def as_bilinear(form):
    """A form as a :class:`Bilinear` one, if it is: the product of the first powers of two
    different sites (``w * x``, a :class:`Product` as the lattice first finds it) is."""
    if isinstance(form, Bilinear):
        return form
    if isinstance(form, Product) and len(form.terms) == 2 and all(a == 1.0 for _, a in form.terms):
        (x, _), (y, _) = sorted(form.terms)
        return Bilinear(frozenset([x]), frozenset([y]), frozenset(), form.mixes)
    return None


def first_powers(form) -> bool:
    """Whether ``form`` is the first power of a site, or elementwise a choice between first
    powers of several sites (a scan's carry that starts at one latent and goes on with
    another): affine when the sites are Gaussian."""
    return isinstance(form, Power | Choice) and _as_affine(form) is not None


def _terms(form) -> dict:
    """site → exponent of a power or product form."""
    if isinstance(form, Power):
        return {form.site: form.power}
    return dict(form.terms)


def _choices(form) -> frozenset:
    return frozenset([(form.site, form.power)]) if isinstance(form, Power) else form.terms


def _monomial(terms: dict, unit: bool, mixes: bool):
    terms = {k: v for k, v in terms.items() if v != 0.0}
    if not terms:
        return Const()
    if len(terms) == 1:
        ((site, power),) = terms.items()
        return Power(site, power, unit, mixes)
    return Product(frozenset(terms.items()), mixes)


def _log_sites(form):
    """The sites of a form affine in logs of sites (LogPower, LogProduct), else None."""
    if isinstance(form, LogPower):
        return frozenset([form.site])
    if isinstance(form, LogProduct):
        return form.sites
    return None


def join(a, b):
    """The form of an array whose elements take form ``a`` or ``b`` (a selection, a
    concatenation, a loop's carry over iterations)."""
    if a == b:
        return a
    if isinstance(a, Opaque):
        return a
    if isinstance(b, Opaque):
        return b
    if isinstance(a, Const) and isinstance(b, Const):
        return Const()
    if isinstance(a, Power) and isinstance(b, Power) and (a.site, a.power) == (b.site, b.power):
        return Power(a.site, a.power, a.unit and b.unit, a.mixes or b.mixes)
    if isinstance(a, LogPower) and isinstance(b, LogPower) and (a.site, a.power) == (b.site, b.power):
        return LogPower(a.site, a.power, a.mixes or b.mixes)
    if isinstance(a, Power | Choice) and isinstance(b, Power | Choice):
        terms = _choices(a) | _choices(b)
        return Choice(terms, a.mixes or b.mixes)
    fa, fb = _as_affine(a), _as_affine(b)
    if fa is not None and fb is not None:
        return Affine(fa.sites | fb.sites, fa.mixes or fb.mixes)
    la, lb = _log_sites(a), _log_sites(b)
    if la is not None and lb is not None:
        return LogProduct(la | lb, mixes(a) or mixes(b))
    joined = _bilinear_sum(a, b, mixing=False)
    if joined is not None:
        return joined
    return Opaque("elements of different forms in one array")


def _bilinear_sum(a, b, mixing: bool):
    """The bilinear form of a + b (or of an array holding both, ``mixing`` False), or None."""
    ba, bb = as_bilinear(a), as_bilinear(b)
    if ba is None and bb is None:
        return None
    if ba is None:
        a, b, ba, bb = b, a, bb, ba
    if bb is None:
        f = _as_affine(b)
        if f is None:
            return None
        return Bilinear(ba.left, ba.right, ba.affine | f.sites, ba.mixes or f.mixes)
    # two products (of the same sites, or of different ones: ``a1 * x_prev + a2 * x_prev2``, an
    # AR(2) with latent coefficients) are bilinear when one side of each can be put with one
    # side of the other without a site on both sides
    for left, right in ((ba.left | bb.left, ba.right | bb.right), (ba.left | bb.right, ba.right | bb.left)):
        if not left & right:
            return Bilinear(left, right, ba.affine | bb.affine, ba.mixes or bb.mixes or mixing)
    return None


def _scalar(x):
    arr = np.asarray(x)
    return float(arr.reshape(-1)[0]) if arr.size and np.all(arr == arr.reshape(-1)[0]) else None


def _add(a, b, sign):
    if isinstance(a, Const) and isinstance(b, Const):
        if a.value is not None and b.value is not None:
            return Const(a.value + sign * b.value)
        return Const()
    if isinstance(b, Const) and b.value == 0.0:
        return a
    if isinstance(a, Const) and a.value == 0.0 and sign > 0:
        return b
    if isinstance(b, Const) and _log_sites(a) is not None:
        return a
    if isinstance(a, Const) and _log_sites(b) is not None and sign > 0:
        return b
    la, lb = _log_sites(a), _log_sites(b)
    if la is not None and lb is not None:  # log x + log y = log(x y)
        return LogProduct(la | lb, mixes(a) or mixes(b) or bool(la & lb))
    fa, fb = _as_affine(a), _as_affine(b)
    if fa is not None and fb is not None:
        # two terms of one site may read different elements of it
        overlap = bool(fa.sites & fb.sites)
        return Affine(fa.sites | fb.sites, fa.mixes or fb.mixes or overlap)
    for f in (a, b):
        if isinstance(f, Opaque):
            return f
    # (two products summed may read different elements: x[0] c[0] + x[1] c[1])
    summed = _bilinear_sum(a, b, mixing=True)
    if summed is not None:
        return summed
    return Opaque("a sum of a latent's power or link with other terms")


def _mul(a, b):
    if isinstance(a, Const) and isinstance(b, Const):
        if a.value is not None and b.value is not None:
            return Const(a.value * b.value)
        return Const()
    if isinstance(a, Opaque):
        return a
    if isinstance(b, Opaque):
        return b
    if isinstance(a, Const):
        a, b = b, a
    if isinstance(b, Const):
        one = b.value == 1.0
        if isinstance(a, Affine | Bilinear):
            return a
        if isinstance(a, Power):
            return Power(a.site, a.power, a.unit and one, a.mixes)
        if isinstance(a, Product | Choice):
            return a
        if isinstance(a, LogPower):
            if b.value == 0.0:
                return Const(0.0)
            power = None if a.power is None or b.value is None else a.power * b.value
            return LogPower(a.site, power, a.mixes)
        if isinstance(a, LogProduct | Logit):
            return Const(0.0) if b.value == 0.0 else (a if isinstance(a, LogProduct) else Opaque("a scaled logit"))
        return Opaque(f"a scaled {a.link} link")
    if isinstance(a, Power | Product) and isinstance(b, Power | Product):
        # τ·τ is τ², but τ[0]·τ[1] mixes elements
        ta, tb = _terms(a), _terms(b)
        terms = {k: ta.get(k, 0.0) + tb.get(k, 0.0) for k in ta.keys() | tb.keys()}
        unit = getattr(a, "unit", False) and getattr(b, "unit", False)
        return _monomial(terms, unit, mixes(a) or mixes(b) or bool(ta.keys() & tb.keys()))
    fa, fb = _as_affine(a), _as_affine(b)
    if fa is not None and fb is not None and not fa.sites & fb.sites:
        return Bilinear(fa.sites, fb.sites, frozenset(), fa.mixes or fb.mixes)
    return Opaque("a product of latents")


def _div(a, b):
    if isinstance(b, Const):
        if isinstance(a, Const):
            if a.value is not None and b.value not in (None, 0.0):
                return Const(a.value / b.value)
            return Const()
        inverse = Const(None if b.value in (None, 0.0) else 1.0 / b.value)
        return _mul(a, inverse)
    if isinstance(b, Opaque):
        return b
    if isinstance(b, Power | Product):
        inverse = _monomial({k: -v for k, v in _terms(b).items()}, getattr(b, "unit", False), b.mixes)
        if isinstance(a, Const):
            return _mul(inverse, a) if a.value != 1.0 else inverse
        return _mul(a, inverse)
    return Opaque("a division by a latent")


def _power(a, exponent):
    if isinstance(a, Const):
        if a.value is None or (a.value < 0 and exponent != int(exponent)) or (a.value == 0 and exponent < 0):
            return Const()
        return Const(float(a.value**exponent))
    if isinstance(a, Power | Product):
        return _monomial({k: v * exponent for k, v in _terms(a).items()}, getattr(a, "unit", False), a.mixes)
    if isinstance(a, Choice):
        return Choice(frozenset((k, v * exponent) for k, v in a.terms), a.mixes)
    if exponent == 1.0:
        return a
    if isinstance(a, Opaque):
        return a
    return Opaque("a power of an affine form")


def _exp(a):
    if isinstance(a, Const):
        return Const(None if a.value is None or a.value > 700 else math.exp(a.value))
    if isinstance(a, LogPower):
        if a.power is None:
            return Opaque("exp of a multiple of a latent's log")
        return Power(a.site, a.power, False, a.mixes)
    f = _as_affine(a)
    if f is not None:
        return Linked("exp", f.sites, f.mixes)
    return a if isinstance(a, Opaque) else Opaque("exp of a latent's power")


def _log(a):
    if isinstance(a, Const):
        return Const(None if a.value is None or a.value <= 0 else math.log(a.value))
    if isinstance(a, Power):
        return LogPower(a.site, a.power, a.mixes)
    if isinstance(a, Product | Choice):
        return LogProduct(sites_of(a), a.mixes)
    if isinstance(a, Linked) and a.link == "exp":
        return Affine(a.sites, a.mixes)
    return a if isinstance(a, Opaque) else Opaque("log of an affine form")


def _reduce_sum(a, eqn):
    axes = eqn.params.get("axes", ())
    shape = eqn.invars[0].aval.shape
    if isinstance(a, Const):
        return Const()
    if math.prod(shape[i] for i in axes) <= 1:
        return a
    f = _as_affine(a)
    if f is not None:
        return Affine(f.sites, True)
    bil = as_bilinear(a)
    if bil is not None:
        return dataclasses.replace(bil, mixes=True)
    return a if isinstance(a, Opaque) else Opaque("a sum over a latent's powers")


def _dot_general(a, b, eqn):
    if isinstance(a, Const) and isinstance(b, Const):
        return Const()
    if not isinstance(a, Const) and not isinstance(b, Const):
        fa, fb = _as_affine(a), _as_affine(b)
        if fa is not None and fb is not None and not fa.sites & fb.sites:
            (contract_a, _), _ = eqn.params["dimension_numbers"]
            size = math.prod(eqn.invars[0].aval.shape[i] for i in contract_a)
            return Bilinear(fa.sites, fb.sites, frozenset(), fa.mixes or fb.mixes or size > 1)
        return a if isinstance(a, Opaque) else (b if isinstance(b, Opaque) else Opaque("a product of latents"))
    (contract_a, contract_b), _ = eqn.params["dimension_numbers"]
    side = 0 if not isinstance(a, Const) else 1
    latent, contract = (a, contract_a) if side == 0 else (b, contract_b)
    shape = eqn.invars[side].aval.shape
    f = _as_affine(latent)
    if f is None:
        return latent if isinstance(latent, Opaque) else Opaque("a contraction of a latent's powers")
    return Affine(f.sites, f.mixes or math.prod(shape[i] for i in contract) > 1)


def _sub_jaxprs(eqn) -> list:
    out = []
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr"):
        sub = eqn.params.get(key)
        if sub is None:
            continue
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
            out.append((key, inner, tuple(getattr(sub, "consts", ()))))
    return out


def _literal(v):
    value = getattr(v, "val", None)
    return Const(_scalar(value) if value is not None and np.size(value) == 1 else None)


class _Interpreter:
    def __init__(self):
        self.primitives: set = set()

    def run(self, jaxpr, in_forms: Sequence, consts: Sequence = ()) -> list:
        env: dict = {}
        for var, form in zip(jaxpr.invars, in_forms):
            env[var] = form
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = Const(_scalar(c) if np.size(c) == 1 else None)

        def read(v):
            if isinstance(v, jex_core.Literal):
                return _literal(v)
            return env.get(v, Const())

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            self.primitives.add(eqn.primitive.name)
            outs = self.equation(eqn, ins)
            for var, form in zip(eqn.outvars, outs):
                env[var] = form
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins) -> list:
        name = eqn.primitive.name
        n_out = len(eqn.outvars)
        if all(isinstance(f, Const) for f in ins) and name not in _CONST_ARITHMETIC:
            return [Const()] * n_out
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "while":
            return self.while_loop(eqn, ins)
        if name == "cond":
            return self.cond(eqn, ins)
        subs = _sub_jaxprs(eqn)
        if subs:
            _, sub, consts = subs[0]
            if len(sub.invars) != len(ins):
                return [_opaque_of(name, ins)] * n_out
            outs = self.run(sub, ins, consts)
            call = eqn.params.get("name")
            if call and not any(isinstance(f, Opaque) for f in ins):
                # name the function a user called (softplus), not the primitive inside it
                outs = [Opaque(f"'{call}' of a latent") if isinstance(f, Opaque) else f for f in outs]
            return outs
        out = self.primitive(eqn, name, ins)
        return out if isinstance(out, list) else [out] * n_out

    def primitive(self, eqn, name, ins):
        if name in _LAYOUT:
            return ins[0]
        if name == "convert_element_type":
            a = ins[0]
            new = np.dtype(eqn.params["new_dtype"])
            if not np.issubdtype(new, np.floating) and not isinstance(a, Const):
                return Opaque("a latent converted to integers")
            return a
        if name in _INDEXED:
            if any(not isinstance(f, Const) for f in ins[1:]):
                return Opaque(f"an index computed from a latent ({name})")
            return ins[0]
        if name in ("concatenate", "pad", "stack"):
            out = ins[0]
            for f in ins[1:]:
                out = join(out, f)
            return out
        if name == "select_n":
            if not isinstance(ins[0], Const):
                return Opaque("a choice that depends on a latent's value")
            out = ins[1]
            for f in ins[2:]:
                out = join(out, f)
            return out
        if name == "dynamic_update_slice":  # (operand, update, *start indices)
            if any(not isinstance(f, Const) for f in ins[2:]):
                return Opaque("an index computed from a latent (dynamic_update_slice)")
            return join(ins[0], ins[1])
        if name == "scatter":  # (operand, indices, updates): each element set once
            if not isinstance(ins[1], Const):
                return Opaque("an index computed from a latent (scatter)")
            return join(ins[0], ins[2])
        if name == "scatter-add" or name == "scatter_add":
            if not isinstance(ins[1], Const):
                return Opaque("an index computed from a latent (scatter-add)")
            out = _add(ins[0], ins[2], 1.0)
            return Affine(out.sites, True) if isinstance(out, Affine) else out
        if name == "add" or name == "add_any":
            return _add(ins[0], ins[1], 1.0)
        if name == "sub":
            if isinstance(ins[1], Const):
                return _add(ins[0], ins[1], -1.0)
            return _add(ins[0], self.primitive(eqn, "neg", ins[1:]), 1.0)
        if name == "neg":
            a = ins[0]
            if first_powers(a):  # (−x, and −(a choice between first powers): affine)
                return _as_affine(a)
            if isinstance(a, Const | Affine | LogPower | LogProduct):
                return _mul(a, Const(-1.0))
            if as_bilinear(a) is not None:
                return as_bilinear(a)
            return a if isinstance(a, Opaque) else Opaque("a negated power or link of a latent")
        if name == "mul":
            return _mul(ins[0], ins[1])
        if name == "div":
            return _div(ins[0], ins[1])
        if name == "integer_pow":
            return _power(ins[0], float(eqn.params["y"]))
        if name == "square":
            return _power(ins[0], 2.0)
        if name == "sqrt":
            return _power(ins[0], 0.5)
        if name == "rsqrt":
            return _power(ins[0], -0.5)
        if name == "pow":
            if isinstance(ins[1], Const) and ins[1].value is not None:
                return _power(ins[0], ins[1].value)
            return _opaque_of(name, ins)
        if name == "exp":
            return _exp(ins[0])
        if name == "log":
            return _log(ins[0])
        if name == "logistic":
            f = _as_affine(ins[0])
            if f is not None:
                return Linked("sigmoid", f.sites, f.mixes)
            return _opaque_of(name, ins)
        if name == "reduce_sum":
            return _reduce_sum(ins[0], eqn)
        if name == "cumsum":
            f = _as_affine(ins[0])
            return Affine(f.sites, True) if f is not None else _opaque_of(name, ins)
        if name == "dot_general":
            return _dot_general(ins[0], ins[1], eqn)
        if name in ("iota", "random_bits", "random_seed", "random_wrap", "random_unwrap", "stop_gradient"):
            return _opaque_of(name, ins) if name == "stop_gradient" and not isinstance(ins[0], Const) else Const()
        return _opaque_of(name, ins)

    def scan(self, eqn, ins):
        (_, body, consts), = _sub_jaxprs(eqn)[:1]
        num_consts, num_carry = eqn.params["num_consts"], eqn.params["num_carry"]
        head, carry, xs = ins[:num_consts], list(ins[num_consts : num_consts + num_carry]), ins[num_consts + num_carry :]
        for _ in range(8):
            outs = self.run(body, head + carry + xs, consts)
            grown = [join(c, o) for c, o in zip(carry, outs[:num_carry])]
            if grown == carry:
                # stacked outputs: each step's output at its own position (no mixing)
                return grown + outs[num_carry:]
            carry = grown
        return [Opaque("a scan whose carries do not settle")] * len(eqn.outvars)

    def while_loop(self, eqn, ins):
        body = eqn.params["body_jaxpr"]
        cond = eqn.params["cond_jaxpr"]
        nb, nc = eqn.params["body_nconsts"], eqn.params["cond_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc : nc + nb], list(ins[nc + nb :])
        for _ in range(8):
            pred = self.run(cond.jaxpr, cond_consts + carry, cond.consts)
            if not all(isinstance(p, Const) for p in pred):
                return [Opaque("a loop whose length depends on a latent")] * len(eqn.outvars)
            outs = self.run(body.jaxpr, body_consts + carry, body.consts)
            grown = [join(c, o) for c, o in zip(carry, outs)]
            if grown == carry:
                return grown
            carry = grown
        return [Opaque("a loop whose carries do not settle")] * len(eqn.outvars)

    def cond(self, eqn, ins):
        if not isinstance(ins[0], Const):
            return [Opaque("a branch chosen by a latent's value")] * len(eqn.outvars)
        outs = None
        for branch in eqn.params["branches"]:
            res = self.run(branch.jaxpr, ins[1:], branch.consts)
            outs = res if outs is None else [join(a, b) for a, b in zip(outs, res)]
        return outs


def _opaque_of(name, ins) -> Form:
    if all(isinstance(f, Const) for f in ins):
        return Const()
    for f in ins:
        if isinstance(f, Opaque):
            return f
    return Opaque(f"'{name}' of a latent")


def jaxpr_forms(jaxpr, in_forms: Sequence, consts: Sequence = ()) -> tuple[list, set]:
    """The forms of a jaxpr's outputs given its inputs' forms, and the primitives it uses."""
    interp = _Interpreter()
    return interp.run(jaxpr, in_forms, consts), interp.primitives


def inverse_link(form, link: str):
    """The form of g⁻¹(x) for a link g (``"identity"``, ``"exp"``, ``"sigmoid"``) and x of
    ``form``: the projection a quadrature factor would integrate over."""
    if link == "identity":
        return form
    if link == "exp":
        return _log(form)
    if isinstance(form, Const):
        return Const()
    if isinstance(form, Linked) and form.link == "sigmoid":
        return Affine(form.sites, form.mixes)
    if isinstance(form, Power) and form.power == 1.0 and form.unit:
        return Logit(form.site, form.mixes)
    return form if isinstance(form, Opaque) else Opaque("logit of a form other than a sigmoid")


# -- classification once the blocks are known -----------------------------------------------

#: transforms of a Gaussian block on an unconstrained space that the forms read: the site
#: is exp(u) or sigmoid(u) of the block's value u
_LINK_OF_TRANSFORM = {"ExpTransform": "exp", "SigmoidTransform": "sigmoid"}


def _unwrap_transform(t):
    while type(t).__name__ == "IndependentTransform":  # event dims only
        t = t.base_transform
    return t


def _scaled_exp(t):
    """exp followed by x ↦ c·x (c > 0, e.g. a positive support's bijection composed with a
    zero shift) reads as exp: log(c eᵘ) is affine in u."""
    if type(t).__name__ != "ComposeTransform":
        return t
    parts = [_unwrap_transform(p) for p in t.parts]
    if len(parts) == 2 and type(parts[0]).__name__ == "ExpTransform" and type(parts[1]).__name__ == "AffineTransform":
        try:
            loc, scale = np.asarray(parts[1].loc), np.asarray(parts[1].scale)
        except Exception:  # traced parameters: not known at compile time
            return t
        if np.all(loc == 0) and np.all(scale > 0):
            return parts[0]
    return t


#: the most scalars per plate element of a dense Gaussian read through its site's moments
#: (:func:`interval_gaussian`: the moments are a tensor quadrature over them)
INTERVAL_MAX_DIM = 3


def interval_gaussian(block) -> bool:
    """Whether a block is Gaussians on the logit space of an interval, elementwise (its site
    value is g(u) = a + b·sigmoid(u)): independent scalars, or dense over at most
    :data:`INTERVAL_MAX_DIM` scalars per plate element (``Uniform(-1, 1).expand([2]).to_event(1)``)."""
    family = block.family
    if not family.gaussian or block.members or block.point or block.local is not None:
        return False
    if type(family).__name__ not in ("GaussianDiag", "GaussianDense") or getattr(family, "dim", 1) > INTERVAL_MAX_DIM:
        return False
    transform = _unwrap_transform(block.transform)
    parts = [_unwrap_transform(p) for p in getattr(transform, "parts", (transform,))]
    names = [type(p).__name__ for p in parts]
    return bool(names) and names[0] == "SigmoidTransform" and set(names[1:]) <= {"AffineTransform"}


def site_space(block) -> str:
    """How a site's value relates to its block's: ``"affine"`` (a Gaussian on the site's own
    space), ``"exp"`` / ``"sigmoid"`` (a Gaussian on log / logit space), ``"other"`` (another
    bijection), or the block's kind (``"gamma"``, ``"beta"``, ``"dirichlet"``)."""
    if block.family.gaussian:
        transform = _scaled_exp(_unwrap_transform(block.transform))
        if transform is None:
            return "affine"
        return _LINK_OF_TRANSFORM.get(type(transform).__name__, "other")
    return block.kind


def why_not_exact(form) -> str:
    """A short reason for a factor table: what makes an argument without a closed form."""
    if isinstance(form, Opaque):
        return form.reason
    if isinstance(form, Linked):
        return f"{form.link} of an affine form"
    if isinstance(form, Power):
        if form.power == 1.0:
            return f"'{form.site}'" if form.unit else f"a multiple of '{form.site}'"
        return f"a power {form.power:g} of '{form.site}'"
    if isinstance(form, LogPower):
        return f"the log of '{form.site}'"
    if isinstance(form, Logit):
        return f"the logit of '{form.site}'"
    if isinstance(form, Product):
        return "a product of latents"
    if isinstance(form, Choice):
        return "a choice between latents' powers"
    if isinstance(form, LogProduct):
        return "a sum of latents' logs"
    if isinstance(form, Bilinear):
        return "a contraction of products of latents" if form.mixes else "a product of latents"
    return ""


def describe_form(form) -> str:
    """One-word summary of a form (for tests and debugging)."""
    if isinstance(form, Const):
        return "const"
    if isinstance(form, Affine):
        return "affine" + ("(mixing)" if form.mixes else "")
    if isinstance(form, Power):
        return f"power({form.site}, {form.power:g})"
    if isinstance(form, LogPower):
        return f"log-power({form.site}, {form.power:g})"
    if isinstance(form, Linked):
        return f"{form.link}(affine)"
    if isinstance(form, Bilinear):
        return "bilinear" + ("(mixing)" if form.mixes else "")
    return f"opaque: {form.reason}"
