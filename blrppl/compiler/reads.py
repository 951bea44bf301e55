"""Which elements of its blocks each argument reads: the element ids of the model's program
(:mod:`blrppl.model.elements`) under the blocks' granules.

A block's scalars are grouped into *granules* two ways: each scalar its own (key
``(block, SCALAR)``), and, for a dense Gaussian block with plate axes, each plate element one
(key ``(block, PLATE)``: the scalars whose covariance the block holds together). An
argument's reads of a key say, element by element, which granules it reads
(:class:`blrppl.model.elements.Reads`: none, one, a pair, several). From them:

* :func:`mixed_blocks` — the blocks an argument mixes (an element reading several granules):
  read through their covariance columns (Gaussian kinds), or not in closed form;
* :func:`whole_matrices` — whether a matrix-valued block is read whole, in place or
  transposed, one matrix per output matrix;
* :func:`coupled_blocks` — the blocks two arguments of one factor read at different elements
  (``value = x[1:]`` with ``loc = x[:-1]``);
* :func:`group_positions` — which positions of a group of discrete latents each element of a
  factor reads (a hidden Markov chain's pairs: :mod:`blrppl.graph.markov`);
* :func:`block_reads` — which positions of one block each element of each factor reads (a
  chain's bandwidth, an arrowhead's local parts: :mod:`blrppl.graph.band`).

A joint block's granules run over its members' scalars (:meth:`Block.member_positions`); a
member on an unconstrained space reaches its site through its bijection, whose own program
says which block scalars each site scalar reads (stick-breaking mixes them, ``exp`` does not).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from blrppl.model import elements as el
from blrppl.model import scan_map
from blrppl.compiler.dependencies import ELEMENTS

#: granules of single scalars
SCALAR = "scalar"
#: granules of plate elements (dense Gaussian blocks with plate axes)
PLATE = "plate"
#: granules of the positions of a group of discrete latents (:func:`group_positions`)
POSITIONS = "positions"


def granule_kind(block, gaussian_kind: bool) -> str:
    """The granules a test reads a block by: plate elements for a dense Gaussian block read by
    a Gaussian kind (it holds their covariance), single scalars otherwise."""
    return PLATE if gaussian_kind and block.family.dense_event else SCALAR


def _block_granules(block) -> dict:
    """kind → the granule id of each scalar of the block's variable, in its value layout."""
    shape = tuple(block.value_shape)
    out = {SCALAR: np.arange(math.prod(shape), dtype=np.int64).reshape(shape)}
    if block.family.dense_event and not block.discrete:
        batch = tuple(block.batch_shape)
        canon = np.broadcast_to(np.arange(math.prod(batch), dtype=np.int64).reshape(batch + (1,)),
                                batch + (max(block.size // max(math.prod(batch), 1), 1),))
        out[PLATE] = np.asarray(block.to_site(np.ascontiguousarray(canon))).reshape(shape)
    return out


def _through_transform(transform, ids: np.ndarray, site_shape):
    """What a site's scalars read of the block variable's granules ``ids``, through the
    bijection (stick-breaking mixes them, ``exp`` does not)."""
    if transform is None:
        return ids.reshape(site_shape)
    closed = jax.make_jaxpr(transform)(jax.ShapeDtypeStruct(ids.shape, jnp.result_type(float)))
    (out,) = el.element_reads(closed.jaxpr, closed.consts, [{0: ids}], [None])
    if 0 not in out:
        return np.full(site_shape, el.NONE, dtype=np.int64)
    return el.Reads(*(np.reshape(a, site_shape) for a in out[0]))


def site_granules(blocks: dict, site_shapes: dict) -> dict:
    """site → key → the granule ids of the site value's scalars (latent sites of continuous
    blocks; discrete ones read no granule: their values are fixed by the enumeration)."""
    out: dict = {}
    for n, b in blocks.items():
        if b.discrete:
            continue
        for kind, ids in _block_granules(b).items():
            if b.members:
                flat = ids.reshape(-1)
                for m, positions in zip(b.members, b.member_positions()):
                    member = flat[positions].reshape(tuple(m.value_shape))
                    site = _through_transform(m.transform, member, site_shapes[m.name])
                    out.setdefault(m.name, {})[(n, kind)] = site
            else:
                site = _through_transform(b.transform, ids, site_shapes[b.name])
                out.setdefault(b.name, {})[(n, kind)] = site
    return out


def _input_shapes(program) -> dict:
    shapes = {}
    for var, name in zip(program.jaxpr.jaxpr.invars, program.names):
        if name is not None and name not in shapes:
            shapes[name] = tuple(var.aval.shape)
    return shapes


def _mapped(program) -> tuple:
    """``(jaxpr, consts)`` of the traced program with its scans whose carries are known ahead
    evaluated as maps over their steps (:func:`blrppl.model.scan_map.vectorise`: the same
    values, so the same reads, without a loop of T steps to follow one by one), computed once
    per program."""
    if "mapped" not in program.cache:
        program.cache["mapped"] = scan_map.vectorise(program.jaxpr.jaxpr, program.jaxpr.consts)
    return program.cache["mapped"]


def _run(program, granules: dict) -> dict:
    """site → item → key → :class:`blrppl.model.elements.Reads` of the traced program with
    the sites' granules ``granules`` (site → key → ids)."""
    jaxpr, consts = _mapped(program)
    extra = iter(program.extra)
    in_ids, in_values = [], []
    for name in program.names:
        if name is None:
            in_ids.append({})
            in_values.append(next(extra))
        else:
            in_ids.append(granules.get(name, {}))
            in_values.append(None)
    outs = el.element_reads(jaxpr, consts, in_ids, in_values)
    return jax.tree.unflatten(program.treedef, outs)


def group_positions(program, blocks: dict, groups) -> dict:
    """For each group of single-site discrete blocks (in model order), which of its
    *positions* (the members' values flattened in C order, concatenated: what
    :mod:`blrppl.graph.markov` reads chains in) every element of every site's log-density
    reads: group → site → :class:`blrppl.model.elements.Reads` (None for a site reading none).
    One reading of the program for all groups."""
    granules: dict = {}
    for group in groups:
        offset = 0
        for n in group:
            b = blocks[n]
            granules.setdefault(n, {})[(group, POSITIONS)] = offset + np.arange(b.size).reshape(b.value_shape)
            offset += b.size
    found = _run(program, granules)
    return {g: {site: items["log_prob"].get((g, POSITIONS)) for site, items in found.items()} for g in groups}


def block_reads(program, blocks: dict, name: str, factors, parts: dict | None = None) -> dict:
    """What each element of each factor reads of the *positions* of block ``name`` (its value
    flattened in C order, a joint block's members in its own layout): factor → Reads
    (:class:`blrppl.model.elements.Reads`; absent for a factor reading none of it, None for
    one whose elements the reading cannot pair).

    An element is one of the factor's unwrapped log-density's (its arguments at one batch
    element of the distribution inside ``Independent``, each over its event dims), except for a rule with an ``event_window`` w
    (:class:`blrppl.rules.registry.Rule`): there each position t of the value's last axis is
    one, reading positions t − w + 1 … t of the value and its batch element's arguments.

    With ``parts`` (part → (start, stop) positions), factor → part → Reads, each part's
    positions alone the granules (the others read as nothing).
    """
    block = blocks[name]
    positions = np.arange(block.size, dtype=np.int64).reshape(block.value_shape)
    if parts is None:
        keyed = {SCALAR: positions}
    else:
        keyed = {p: np.where((positions >= lo) & (positions < hi), positions, el.NONE) for p, (lo, hi) in parts.items()}
    shapes = _input_shapes(program)
    granules: dict = {}
    for key, ids in keyed.items():
        if block.members:
            flat = ids.reshape(-1)
            for m, pos in zip(block.members, block.member_positions()):
                site = _through_transform(m.transform, flat[pos].reshape(tuple(m.value_shape)), shapes[m.name])
                granules.setdefault(m.name, {})[(name, key)] = site
        else:
            granules.setdefault(block.name, {})[(name, key)] = _through_transform(block.transform, ids, shapes[name])
    found = _run(program, granules)
    out: dict = {}
    for f in factors:
        items = found.get(f.name)
        if items is None:
            continue
        per_key = {key: _element_reads(f, items, (name, key)) for key in keyed}
        if all(r is _NOTHING for r in per_key.values()):
            continue
        if any(r is None for r in per_key.values()):
            out[f.name] = None
        elif parts is None:
            out[f.name] = per_key[SCALAR] if per_key[SCALAR] is not _NOTHING else None
        else:
            out[f.name] = {p: r for p, r in per_key.items() if r is not _NOTHING}
    return out


#: a factor reading nothing of a key
_NOTHING = object()


def _element_reads(f, items: dict, key):
    """The reads of ``key`` per element of factor ``f`` (see :func:`block_reads`):
    :data:`_NOTHING` when it reads none, None when an argument cannot be paired with the
    value's positions."""
    window = getattr(f.rule, "event_window", None) if f.rule is not None else None
    if not window:
        r = items.get(ELEMENTS, items.get("log_prob", {})).get(key)
        return _NOTHING if r is None else r
    value = items["value"].get(key)
    others = [items[a].get(key) for a in f.rule.arg_names if a in items and a != "value"]
    if value is None:
        # (the block read through the other arguments only: no element layout to pair with)
        return _NOTHING if all(r is None for r in others) else None
    v = el.channels(value)
    shape = v.shape[:-1]
    none = np.broadcast_to(el.channels(el.Reads(np.full(shape, el.NONE), np.full(shape, el.NONE), np.zeros(shape, int))),
                           shape + (3,))
    out = v
    for k in range(1, window):  # positions t − k of the value, for each t
        if k < shape[-1]:
            out = el.union(out, np.concatenate([none[..., :k, :], v[..., : shape[-1] - k, :]], axis=-2))
    for r in others:
        if r is None:
            continue
        c = el.channels(r)
        extra = c.ndim - 1 - (len(shape) - 1)
        if extra > 0:  # (an argument's own event axes: one element of the batch)
            c = el.reduce_union(c, tuple(range(c.ndim - 1 - extra, c.ndim - 1)))
        try:
            out = el.union(out, np.broadcast_to(c[..., None, :], shape + (3,)))
        except ValueError:
            return None
    return el.from_channels(np.asarray(out))


def argument_reads(program, blocks: dict) -> dict:
    """site → item → key → the element ids of every item of the traced program
    (:attr:`blrppl.compiler.stages.Dependencies.program`) under the blocks' granules."""
    return _run(program, site_granules(blocks, _input_shapes(program)))


def mixed_blocks(reads: dict, blocks: dict, names, gaussian_kind: bool) -> tuple:
    """The blocks among ``names`` of which some element of the argument reads several
    granules (:func:`granule_kind`)."""
    out = []
    for n in names:
        found = reads.get((n, granule_kind(blocks[n], gaussian_kind)))
        if found is not None and np.any(el.single(found) == el.MANY):
            out.append(n)
    return tuple(sorted(out))


def whole_matrices(reads: dict, block) -> bool:
    """Whether every output matrix reads one whole D × D matrix of the block, in place or
    transposed (``Λ[group]``, ``Λ.T``, broadcasts), and nothing of it elsewhere; or, selected
    by an index only the enumeration knows (``Λ[z]``), one of them: every entry then reads at
    most one matrix, all in the same place of theirs."""
    found = reads.get((block.name, SCALAR))
    dim = block.value_shape[-1]
    if found is None:
        return True
    lo, hi, count = (np.asarray(a) for a in found)
    if lo.ndim < 2 or lo.shape[-2:] != (dim, dim):
        return False
    code = np.arange(dim * dim).reshape(dim, dim)

    def in_place(ids):
        base = ids[..., :1, :1]
        fine = (base >= 0) & (base % (dim * dim) == 0)
        as_is = np.all(ids == base + code, axis=(-2, -1))
        transposed = np.all(ids == base + code.T, axis=(-2, -1))
        return fine[..., 0, 0] & (as_is | transposed)

    one = np.all(count == 1, axis=(-2, -1))
    some = np.all(count == el.AT_MOST_ONE, axis=(-2, -1))
    return bool(np.all((one & in_place(lo)) | (some & in_place(lo) & in_place(hi))))


def coupled_blocks(reads_by_arg: dict, shared: dict, blocks: dict) -> frozenset:
    """The blocks of ``shared`` (block → the arguments reading it one granule per element)
    that two of those arguments read at different granules of one element of the factor."""
    coupled = set()
    for n, args in shared.items():
        key = (n, granule_kind(blocks[n], True))
        arrays = [el.single(reads_by_arg[a][key]) for a in args if key in reads_by_arg[a]]
        if len(arrays) < 2:
            continue
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
        arrays = [np.broadcast_to(a, shape) for a in arrays]
        for i in range(len(arrays)):
            for j in range(i + 1, len(arrays)):
                a, b = arrays[i], arrays[j]
                both = (a != el.NONE) & (b != el.NONE)
                if np.any(both & ((a != b) | (a < 0))):
                    coupled.add(n)
    return frozenset(coupled)


class ElementReads:
    """The element reads of every item of a traced program under the blocks' granules
    (:func:`argument_reads`), computed once, when first asked for."""

    def __init__(self, program, blocks: dict):
        self._program, self._blocks, self._reads = program, blocks, None

    def of(self, name, item) -> dict:
        """key → ids of one site's item."""
        if self._reads is None:
            self._reads = argument_reads(self._program, self._blocks)
        return self._reads[name][item]

    def mixed(self, name, item, deps):
        """``gaussian_kind → the blocks of deps the item mixes`` (:func:`mixed_blocks`)."""
        cont = [n for n in deps if not self._blocks[n].discrete]
        return lambda gaussian_kind: mixed_blocks(self.of(name, item), self._blocks, cont, gaussian_kind)
