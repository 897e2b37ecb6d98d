"""``tf.distribute.cluster_resolver``'s names: who is who in a multi-host job."""

from phalanx.cluster import (  # noqa: F401
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
)
from phalanx.strategies.tpu import TPUClusterResolver  # noqa: F401  (raises: no TPU support)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TPUClusterResolver",
    "TFConfigClusterResolver",
    "TorchElasticClusterResolver",
]
