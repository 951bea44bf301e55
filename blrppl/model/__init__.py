"""The code that runs or reads the user's model.

* :mod:`blrppl.model.trace` runs the model once and records its sites
  (:mod:`blrppl.model.records`), checking them (:mod:`blrppl.model.checks`);
* :mod:`blrppl.model.program` traces the model into one program of the latent values,
  which :mod:`blrppl.model.functions` evaluates per factor (arguments, log-densities);
* :mod:`blrppl.model.forms` and :mod:`blrppl.model.deps` read the forms of the arguments
  and the latents they depend on off that program; :mod:`blrppl.model.scan_map` evaluates
  its scans as maps over their steps;
* :mod:`blrppl.model.elements` reads which elements of each latent every element of an
  output reads off that program (an abstract interpretation over element ids);
* :mod:`blrppl.model.classes` names the class of each argument from its form (and, where the
  form leaves the plates open, its element reads).

Import the submodules themselves: this package imports none of them.
"""
