import numpyro

# Exactness tests run in float64.
numpyro.enable_x64()
