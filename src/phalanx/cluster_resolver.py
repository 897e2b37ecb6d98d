"""``tf.distribute.cluster_resolver``'s names: who is who in a multi-host job."""

from phalanx.cluster import (  # noqa: F401
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchElasticClusterResolver,
)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchElasticClusterResolver",
]
