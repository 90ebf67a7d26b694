from recpipe.sharding.build import (
    EBC_PATH,
    ShardedModel,
    dense_optimizer,
    plan_table,
    shard_model,
    sharding_plan,
)
from recpipe.torchrec_args import make_sharder

__all__ = ["EBC_PATH", "ShardedModel", "dense_optimizer", "make_sharder", "plan_table", "shard_model", "sharding_plan"]
