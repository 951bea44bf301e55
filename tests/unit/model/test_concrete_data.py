"""Models that need their data as concrete values: which errors send a model to be traced
with its data as constants, how such a program is keyed (by the data's values), and the
error of a model that needs concrete values of a minibatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import random

from blrppl import ModelTraceError, blr_fit
from blrppl.engine.cache import cache_key, stored_fit_key
from blrppl.graph.data import STORED_STATIC_BYTES, DataSpec
from blrppl.inputs import fit_options
from blrppl.model.checks import needs_concrete
from blrppl.model.program import ModelProgram
from blrppl.model.trace import trace_program

numpyro.enable_x64()


def groups_model(g, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([len(set(g))]))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu[g], 1.0), obs=y)


def masked_model(y):
    lam = numpyro.sample("lam", dist.Gamma(2.0, 1.0))
    numpyro.factor("positive", dist.Poisson(lam).log_prob(y[y > 0]).sum())


def plain_model(g, y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0).expand([3]))
    with numpyro.plate("n", len(y)):
        numpyro.sample("y", dist.Normal(mu[g], 1.0), obs=y)


G = np.array([0, 1, 2, 0, 1, 2])
Y = np.arange(6.0)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: len(set(x)),
        lambda x: x[x > 0],
        lambda x: int(x.max()) + 1,
        lambda x: 1 if x[0] > 0 else 0,
        lambda x: np.asarray(x),
    ],
    ids=["set", "boolean mask", "int", "if", "numpy"],
)
def test_the_errors_of_computing_python_values_from_traced_data_need_concrete_data(fn):
    with pytest.raises(Exception) as info:
        jax.jit(fn)(jnp.arange(3.0))
    assert needs_concrete(info.value)


def test_other_type_errors_do_not_need_concrete_data():
    assert not needs_concrete(TypeError("unhashable type: 'list'"))
    assert not needs_concrete(TypeError("unsupported operand type(s) for +: 'int' and 'str'"))


@pytest.mark.parametrize("model, data", [(groups_model, (G, Y)), (masked_model, (np.array([0, 2, 0, 3]),))])
def test_a_model_that_hashes_or_masks_its_data_is_traced_with_them_as_constants(model, data):
    tracer = trace_program(model, data)
    assert tracer.spec.all_static


def test_the_key_of_a_model_holding_its_data_changes_with_their_values_only():
    """Equal values (another array object) give one key; a changed value another, in the
    compiled-fit cache and in the program store; a model whose data travel as arrays keys
    their shapes, not their values."""
    options = fit_options()

    def keys(model, g, y):
        program = ModelProgram(model)
        tracer = trace_program(model, (g, y))
        dyn = DataSpec.split((g, y), {}, all_static=tracer.spec.all_static)[1]
        return cache_key(program, tracer, dyn, options, None), tracer

    first, tracer = keys(groups_model, G, Y)
    assert first is not None and hash(first) is not None
    assert keys(groups_model, G.copy(), Y.copy())[0] == first
    assert keys(groups_model, G, Y + 1.0)[0] != first
    assert keys(plain_model, G, Y)[0] == keys(plain_model, G, Y + 1.0)[0]

    class Plan:  # (the parts of a plan the store's key reads)
        def describe(self):
            return "plan"

        def structure_digest(self):
            return "digest"

    stored = [stored_fit_key(keys(groups_model, G, y)[1], (), options, None, (), Plan()) for y in (Y, Y.copy(), Y + 1)]
    assert stored[0] is not None and stored[0] == stored[1] != stored[2]


def test_a_model_holding_large_data_is_not_stored():
    n = STORED_STATIC_BYTES // 8 + 1
    g, y = np.zeros(n, dtype=np.int64), np.zeros(n)
    tracer = trace_program(groups_model, (g, y))
    assert tracer.spec.all_static and tracer.spec.static_bytes() > STORED_STATIC_BYTES

    class Plan:
        def describe(self):
            return "plan"

        def structure_digest(self):
            return "digest"

    assert stored_fit_key(tracer, (), fit_options(), None, (), Plan()) is None


def minibatch_mask_model(y):
    lam = numpyro.sample("lam", dist.Gamma(2.0, 1.0))
    with numpyro.plate("n", len(y), subsample_size=3) as idx:
        batch = jnp.asarray(y)[idx]
        numpyro.factor("positive", dist.Poisson(lam).log_prob(batch[batch > 0]).sum())


def test_a_mask_of_a_minibatch_is_refused_naming_the_plate_and_jnp_where():
    with pytest.raises(ModelTraceError, match=r"subsampled plate 'n'.*jnp\.where"):
        blr_fit(minibatch_mask_model, np.array([0, 2, 0, 3, 1, 0]), rng_key=random.PRNGKey(0), progress_bar=False)


def test_the_users_data_are_not_changed():
    g, y = G.copy(), Y.copy()
    blr_fit(groups_model, (g, y), rng_key=random.PRNGKey(0), progress_bar=False, num_steps=5)
    np.testing.assert_array_equal(g, G)
    np.testing.assert_array_equal(y, Y)
    assert g.flags.writeable and y.flags.writeable
