from recpipe.models.dlrm import RecModel, build_model, embedding_configs
from recpipe.callables import load_callable
from recpipe.models.factory import make_model
from recpipe.models.precision import PRECISIONS, remove_precision, with_precision

__all__ = ["PRECISIONS", "RecModel", "build_model", "embedding_configs", "load_callable", "make_model",
           "remove_precision", "with_precision"]
