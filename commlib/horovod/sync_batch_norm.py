"""``hvd.SyncBatchNorm``: commlib's synchronized batch norm (torch's constructor; Horovod's
``num_features, eps, momentum, affine, track_running_stats`` in Horovod's order), its
statistics over the Horovod world."""
from ..nn import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
