from recpipe.models.dlrm import RecModel, build_model, embedding_configs
from recpipe.models.factory import load_callable, make_model
from recpipe.models.precision import PRECISIONS, remove_precision, with_precision

__all__ = ["PRECISIONS", "RecModel", "build_model", "embedding_configs", "load_callable", "make_model",
           "remove_precision", "with_precision"]
