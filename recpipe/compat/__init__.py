"""The seam to torchrec's, FBGEMM's and torch's insides.

Every read or write of a library's private name, and every replacement of a library's
method, lives in this package as a named function that says why recpipe needs it and
the versions it was checked against; the rest of recpipe calls those functions.
``scripts/private_names.py`` lists the uses, and tests/test_layers.py fails on one
outside this package; tests/test_compat.py fails when an installed version moved one.

- :mod:`recpipe.compat.torchrec`: sharded modules, KJT all-to-alls, awaitables, KJTs,
  optimizer wrappers, metrics.
- :mod:`recpipe.compat.fbgemm`: the training TBE's per-batch state.
- :mod:`recpipe.compat.torch`: module and optimizer hooks, fused foreach ops, pytrees, the
  autograd engine, the profiler flag, DDP's start-up sync, DCP's pickled names, dynamo and
  inductor settings.
"""
