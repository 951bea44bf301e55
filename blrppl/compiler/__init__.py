"""The compiler: a traced model into blocks, a factor graph and a static plan, in passes
(:func:`blrppl.compiler.pipeline.compile_model`)."""
