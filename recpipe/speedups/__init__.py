"""Speed features, applied to a model and its pipeline from outside the engine.

Each is declared in ``recpipe/speedups/defs/`` (its ``pipeline`` config section, the
capabilities it needs of a pipeline, its config rules; ``recpipe.speedups.definition``),
listed in ``recpipe.speedups.registry.SPEEDUPS``, and implemented by a module here that
installs itself visibly (an instance ``forward``, an optimizer ``step``, a wrapped
pipeline step or a replacement schedule) and returns a printable, removable handle:

=====================  ==================================  =======================================
section                implementation                      what it does
=====================  ==================================  =======================================
``compile``            ``compile.apply_compile``           the dense modules compiled by torch.compile
``cuda_graphs``        ``cuda_graphs.apply_cuda_graphs``   the dense modules' forward/backward and the
                                                           dense optimizer's step replayed as CUDA graphs
``cache_fill``         ``cache_fill.apply_cache_fill``     recpipe's UVM-cache insert in a prefetch step
(always)               ``cache_bookkeeping.apply_...``     FBGEMM's backward pre-hook work on the
                                                           prefetch stream
``step_graph``         ``step_graph.apply_step_graph``     the whole training step as one CUDA graph
=====================  ==================================  =======================================

The builder (``recpipe.builder.make_pipeline``) applies those a ``pipeline`` section
enables, in that order (the graphs record the compiled code), to a pipeline that offers
what each needs. This package imports nothing: its declarations are read without torch.
"""
