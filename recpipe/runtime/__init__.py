"""The machinery every pipeline and every speed feature is built on.

A pipeline is a schedule table (``schedule.py``) run by one engine (``engine.py``) that
calls the shared step functions (``steps.py``) through a step context (``context.py``),
with every cross-stream hand-off in ``streams.py`` and the sharded modules' inputs
prepared ahead of forward (``sharded.py``, ``inputs.py``, ``pooled.py``); ``definition.py``
says what one pipeline is. The pipelines (``recpipe.pipelines``) and the speed features
(``recpipe.speedups``) sit side by side above this package; it imports neither.
This package's ``__init__`` imports nothing.
"""
