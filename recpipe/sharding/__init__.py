from recpipe.sharding.build import (
    EBC_PATH,
    ShardedModel,
    check_model_config,
    dense_optimizer,
    plan_summary,
    plan_table,
    shard_model,
    sharding_plan,
)
from recpipe.torchrec_args import make_sharder, make_sharders

__all__ = [
    "EBC_PATH",
    "ShardedModel",
    "check_model_config",
    "dense_optimizer",
    "make_sharder",
    "make_sharders",
    "plan_summary",
    "plan_table",
    "shard_model",
    "sharding_plan",
]
