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

__all__ = [
    "EBC_PATH",
    "ShardedModel",
    "check_model_config",
    "dense_optimizer",
    "plan_summary",
    "plan_table",
    "shard_model",
    "sharding_plan",
]
