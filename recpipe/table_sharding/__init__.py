"""What ``sharding.*`` becomes in torchrec and FBGEMM, one module per concern.

* :mod:`.sharders`: the torchrec sharders with the TBEs' fused parameters, and the sharding
  types they offer;
* :mod:`.comm`: the quantized-comm codecs of ``sharding.comm_precision`` and the TBE output
  precision that goes with them;
* :mod:`.placement`: the sharding type asked of torchrec, the rank or host of each table,
  torchrec's ``ParameterSharding`` generators;
* :mod:`.cache`: FBGEMM's UVM-cache parameters;
* :mod:`.precision`: each table's weight, cache and rounding precision;
* :mod:`.checks`: the sharding rules checked against a model's real tables.

Both :mod:`recpipe.sharding` (which shards the model with them) and :mod:`recpipe.planner`
(which predicts the memory of that sharding, and runs torchrec's partitioner on it) import
from here. The functions take the ``sharding`` section (or one table's ``TableSharding``);
only :func:`.checks.validated_tables`, :func:`.checks.check_tables` and
:func:`.placement.table_wise_ranks` take the whole config. Nothing here touches a process
group or a GPU, and importing any of it loads neither torch, torchrec nor FBGEMM (the
functions that need them do), so the planner's data classes stay cheap to import.
"""
