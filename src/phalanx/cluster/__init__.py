"""Cluster descriptions: who is in a job and where each process sits.

Example:
    >>> from phalanx.cluster import resolve_from_environment
    >>> resolve_from_environment({}) is None  # a plain single-host run
    True
"""

from phalanx.cluster.detect import resolve_from_environment
from phalanx.cluster.placement import (
    TaskPlacement,
    compare_fingerprints,
    own_address_for,
)
from phalanx.cluster.ray_train import RayTrainClusterResolver
from phalanx.cluster.resolver import ClusterResolver
from phalanx.cluster.simple import SimpleClusterResolver
from phalanx.cluster.slurm import SlurmClusterResolver, expand_hostlist
from phalanx.cluster.spec import ClusterSpec
from phalanx.cluster.tfconfig import TFConfigClusterResolver
from phalanx.cluster.torchelastic import TorchElasticClusterResolver
from phalanx.cluster.validation import parse_tf_config, validate_cluster

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "RayTrainClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TaskPlacement",
    "TorchElasticClusterResolver",
    "compare_fingerprints",
    "expand_hostlist",
    "own_address_for",
    "parse_tf_config",
    "resolve_from_environment",
    "validate_cluster",
]
