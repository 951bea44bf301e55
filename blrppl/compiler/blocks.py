"""Blocks as the compiler builds them: their initial values and fill values, discrete groups and
chains, merged joint, banded and arrowhead blocks."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import numpy as np

from blrppl import families as fam
from blrppl.graph import markov
from blrppl.compiler.reads import group_positions
from blrppl.graph.plan import Block, FactorRole


def site_transforms(blocks) -> dict:
    """Site → bijection from the block space to the site's support."""
    out = {}
    for n, b in blocks.items():
        for m in b.members or (b,):
            if m.transform is not None:
                out[m.name] = m.transform
    return out


def is_transformed(block) -> bool:
    """Whether the block (or one of its members) lies on the unconstrained space of its site."""
    return any(m.transform is not None for m in (block.members or (block,)))


def site_fill(blocks, site_init, unconstrained=None) -> dict:
    """Per site, a valid value in block space (unconstrained for transformed sites, from
    ``unconstrained`` where it holds the site: the trace computed it)."""
    out = {}
    unconstrained = unconstrained or {}
    for b in blocks.values():
        for m in b.members or (b,):
            x = site_init[m.name]
            if m.transform is None:
                out[m.name] = x
            elif m.name in unconstrained:
                out[m.name] = unconstrained[m.name]
            else:
                out[m.name] = m.transform.inv(x)
    for name, x in site_init.items():
        out.setdefault(name, x)  # a latent left out of the fit (barren_latents): its initial value
    return out


def block_init_values(blocks, site_init, unconstrained=None) -> dict:
    """Initial values in block space (unconstrained for transformed Gaussian blocks, the
    members' values concatenated for joint blocks; NumPy arrays stay on the host)."""
    fill = site_fill(blocks, site_init, unconstrained)
    out = {}
    for n, b in blocks.items():
        if b.members and b.discrete:
            out[n] = fill[b.members[0].name]  # (unused: discrete blocks start from probabilities)
        elif b.members:
            out[n] = b.join({m.name: fill[m.name] for m in b.members})
        else:
            out[n] = fill[n]
    return out


#: discrete latents coupled in a factor are fitted as one categorical over the product of
#: their values when it has at most this many states per element
MAX_JOINT_STATES = 4096


def coupled_discrete_groups(blocks: dict, factors) -> list:
    """Groups of (global, or in the same plates) discrete blocks that some factor enumerates
    together: their mean-field product q(y) q(z) cannot hold a factor that couples them
    (``z``'s probabilities depending on ``y``), so each group becomes one joint categorical
    block when its elements have the same shape and at most :data:`MAX_JOINT_STATES` states."""
    out = []
    for group in _discrete_groups(blocks, factors):
        parts = [blocks[n] for n in group]
        if len(group) < 2 or any(b.chain for b in parts):
            continue
        shapes = {b.value_shape for b in parts}
        states = math.prod(len(b.support_values) for b in parts)
        if len(shapes) == 1 and states <= MAX_JOINT_STATES and all(b.local is None for b in parts):
            out.append(group)
    return out


def _discrete_groups(blocks: dict, factors) -> list:
    """Groups of discrete blocks that some factor enumerates together (model order; the
    factors may name the sites of a block that holds several)."""
    parent = {n: n for n, b in blocks.items() if b.discrete}
    block_of = {s: n for n, b in blocks.items() if b.discrete for s in b.sites}

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for f in factors:
        names = [block_of[d] for d in f.discrete if d in block_of]
        for a, b in zip(names, names[1:]):
            parent[find(a)] = find(b)
    groups: dict = {}
    for n in parent:
        groups.setdefault(find(n), []).append(n)
    return [tuple(n for n in blocks if n in g) for g in groups.values()]


def discrete_chains(blocks: dict, factors, fns, data, program) -> tuple:
    """Blocks with every group of discrete latents read along a chain replaced by one
    :class:`blrppl.families.CategoricalChain` block, and factor → ``((block, Reads),)``.

    Which positions of a group each factor element reads is read off the model's program
    (:func:`blrppl.compiler.reads.group_positions`, for groups of more than one position).
    If every factor element reads its aligned positions, the enumeration's own assumption
    holds: the group stays as it is, unless it is several sites (one per step of a loop)
    whose joint categorical would be too large and whose factors each read two consecutive
    ones (then it is a chain). Otherwise pairs with one stride make a chain; single
    positions read out of alignment (a gather by an index array) make independent states
    read through the same map.

    Raises:
        UnsupportedFactorError: a factor reads the group in a pattern no first-order chain
            holds.
    """
    reads_of: dict = {}
    out = dict(blocks)
    groups = []
    for group in _discrete_groups(blocks, factors):
        parts = [blocks[n] for n in group]
        if any(b.members for b in parts):
            continue
        if any(b.local is not None for b in parts):
            # (subsampled plates: their factors' plates are checked instead)
            _warn_if_local_chain(group, parts, factors, fns, data)
            continue
        if sum(b.size for b in parts) > 1:
            groups.append(group)
    positions = group_positions(program, blocks, groups) if groups else {}
    for group in groups:
        parts = [blocks[n] for n in group]
        size = sum(b.size for b in parts)
        touching = [f for f in factors if f.role == FactorRole.SITE and set(f.discrete) & set(group)]
        found = {}
        for f in touching:
            r = positions[group].get(f.name)
            found[f.name] = markov.position_reads(r) if r is not None else markov.Reads(
                np.full(_factor_batch(fns, f, data), -1, np.int64), np.full(_factor_batch(fns, f, data), -1, np.int64)
            )
            if found[f.name] is None:
                raise markov.unsupported(f, group, touching)
        if all(markov.is_aligned(parts, f, found[f.name]) for f in touching):
            states = math.prod(len(b.support_values) for b in parts)
            if len(group) == 1 or states <= MAX_JOINT_STATES or len({b.value_shape for b in parts}) != 1:
                continue
            reads = markov.aligned_chain_reads(parts, touching, lambda f: _factor_batch(fns, f, data))
            layout = markov.chain_layout(reads, size) if reads else None
            if layout is None:
                continue
        else:
            if len({b.support_values for b in parts}) != 1:
                raise markov.unsupported(touching[0], group, touching)
            reads = found
            layout = markov.chain_layout(reads, size)
            if layout is None:
                if any(np.any(r.hi >= 0) for r in reads.values()):
                    f = next(f for f in touching if np.any(reads[f.name].hi >= 0))
                    raise markov.unsupported(f, group, touching)
                layout = markov.ChainLayout(1, size)
        k = len(parts[0].support_values)
        family = fam.CategoricalChain(layout.length, k)
        if len(group) == 1:
            chain = dataclasses.replace(
                parts[0], family=family, kind=family.name, value_shape=(size,), site_shape=parts[0].value_shape
            )
        else:
            name = f"({group[0]}, …, {group[-1]})" if len(group) > 3 else "(" + ", ".join(group) + ")"
            chain = Block(name, family, family.name, (size,), (), parts[0].support_values, members=tuple(parts))
        out = _replace_members(out, group, chain)
        for f in touching:
            reads_of[f.name] = reads_of.get(f.name, ()) + ((chain.name, reads[f.name]),)
    return out, reads_of


def _warn_if_local_chain(group, parts, factors, fns, data) -> None:
    """Warn when discrete latents in a subsampled plate, one site per step, form a chain: they
    are fitted mean-field across steps."""
    if len(parts) < 2 or len({b.value_shape for b in parts}) != 1:
        return
    reads = markov.aligned_chain_reads(parts, factors, lambda f: _factor_batch(fns, f, data))
    if reads and markov.chain_layout(reads, sum(b.size for b in parts)) is not None:
        warnings.warn(
            f"blr_fit: the discrete latents {group[0]} … {group[-1]} form a chain inside a subsampled plate: they are "
            "fitted mean-field across steps (a chain block is not available under subsampling; fit without "
            "subsample_size for the forward-backward posterior)",
            UserWarning,
            stacklevel=2,
        )


def _factor_batch(fns, f, data) -> tuple:
    """A factor's element-wise batch shape (of its log-density at the fill values)."""
    return tuple(jax.eval_shape(lambda d: fns.log_probs((f.name,), {}, d)[f.name][0], data).shape)


def merge_discrete(blocks: dict, members: tuple) -> dict:
    """Replace the discrete blocks ``members`` by one categorical block over the product of
    their values (states in ``itertools.product`` order of the members' supports)."""
    parts = tuple(blocks[n] for n in members)
    states = math.prod(len(b.support_values) for b in parts)
    joint = Block(
        "(" + ", ".join(members) + ")", fam.Categorical(states), fam.Categorical.name, parts[0].value_shape, (),
        tuple(range(states)), members=parts,
    )
    return _replace_members(blocks, members, joint)


def _replace_members(blocks: dict, members, joint: Block) -> dict:
    """``blocks`` with ``members`` replaced by ``joint``, at the first member's place."""
    out = {}
    for n, b in blocks.items():
        if n == members[0]:
            out[joint.name] = joint
        elif n not in members:
            out[n] = b
    return out


def banded_block(block: Block, bandwidth: int) -> Block:
    """A Gaussian block (or joint block) with a banded precision over its scalars in C order
    (each member's part too: the marginal of a stretch of a chain is a chain; a member
    stored time-major, every S-th scalar, exports the covariances of its scalars S·d apart
    for S·d within the band: bandwidth b // S, at least 1)."""
    family = fam.GaussianBanded(block.size, bandwidth)
    head, tail, _, widths = block.time_major_layout() if block.members else ((), (), 0, [])
    stride = {m.name: sum(widths) for m in tail}
    parts = []
    for m in block.members:
        width = max(bandwidth // stride.get(m.name, 1), 1)
        if m.size > width + 1:
            m = dataclasses.replace(m, family=fam.GaussianBanded(m.size, width), kind=family.name)
        parts.append(m)
    return dataclasses.replace(block, family=family, kind=family.name, plate_axes=(), members=tuple(parts))


def arrowhead_block(block: Block, globals_: tuple) -> Block:
    """A joint Gaussian block with an arrowhead precision: dense over the positions of
    ``globals_`` ((start, stop) spans), diagonal over the others (its local members: each
    holds its marginal variances, a diagonal family)."""
    family = fam.GaussianArrowhead(block.size, globals_)
    parts, offset = [], 0
    for m in block.members:
        if (offset, offset + m.size) not in globals_:
            m = dataclasses.replace(m, family=fam.GaussianDiag(), kind=fam.GaussianDiag.name)
        parts.append(m)
        offset += m.size
    return dataclasses.replace(block, family=family, kind=family.name, members=tuple(parts))


def merge_gaussians(blocks: dict, members: list, interleaved: int = 0) -> dict:
    """Replace the blocks ``members`` by one dense Gaussian over all their scalars (the last
    ``interleaved`` of them stored step by step: :attr:`Block.interleaved`)."""
    parts = tuple(
        Block(n, fam.GaussianDense(blocks[n].size), fam.GaussianDense.name, blocks[n].value_shape, (), None,
              blocks[n].transform, blocks[n].site_shape)
        for n in members
    )
    size = sum(p.size for p in parts)
    joint = Block(
        "(" + ", ".join(members) + ")", fam.GaussianDense(size), fam.GaussianDense.name, (size,), members=parts,
        interleaved=interleaved,
    )
    return _replace_members(blocks, members, joint)


def time_major(blocks: dict, members: list) -> tuple:
    """``(order, interleaved)`` for a joint block whose members of the most common leading
    length L (at least two of them) are stored step by step after the others
    (:attr:`Block.interleaved`), or ``(None, 0)`` when no two members share a length."""
    lengths: dict = {}
    for n in members:
        shape = blocks[n].value_shape
        if len(shape) >= 1 and shape[0] > 1:
            lengths.setdefault(shape[0], []).append(n)
    shared = [ns for ns in lengths.values() if len(ns) > 1]
    if not shared:
        return None, 0
    tail = max(shared, key=lambda ns: sum(blocks[n].size for n in ns))
    return [n for n in members if n not in tail] + tail, len(tail)


def blocks_by_site(blocks: dict) -> dict:
    """site → (its block's name, the block of the site itself: the member of a joint block,
    else the block)."""
    return {
        s: (n, m) for n, b in blocks.items() for s, m in (((m.name, m) for m in b.members) if b.members else ((x, b) for x in b.sites))
    }
