from recpipe.models.dlrm import RecModel, build_model, embedding_configs

__all__ = ["RecModel", "build_model", "embedding_configs"]
