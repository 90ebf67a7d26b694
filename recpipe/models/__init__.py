from recpipe.models.dlrm import RecModel, build_model, embedding_configs
from recpipe.models.factory import load_callable, make_model

__all__ = ["RecModel", "build_model", "embedding_configs", "load_callable", "make_model"]
