"""What a fit returns and what reads it: the result (:mod:`.result`), the posterior export
per site (:mod:`.export`), guides for NumPyro (:mod:`.guide`, :mod:`.autoguides`), the
diagnostics of q against the model (:mod:`.diagnostics`) and a fit's posterior as the next
fit's prior (:mod:`.online`).

Nothing here imports :mod:`blrppl.engine`: the engine builds on these modules, not the
reverse (what they need of a fit, e.g. the lock held while the user's model runs, is passed
in).
"""
