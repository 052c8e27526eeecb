"""Model definitions: the parameter layout, shared layers, and the hybrid decoder's forward step."""

from jhybrid.models.batch import Batch, RowSpec, make_batch
from jhybrid.models.hybrid import forward
from jhybrid.models.params import count_params, init_params, param_shapes

__all__ = ["Batch", "RowSpec", "count_params", "forward", "init_params", "make_batch", "param_shapes"]
