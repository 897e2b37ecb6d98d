"""``TFConfigClusterResolver``: the cluster from the ``TF_CONFIG`` environment variable.

This is how Kubeflow TFJobs, Vertex AI and TF cluster tooling describe a job, so a phalanx job
launched by them needs no other configuration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from phalanx.cluster.resolver import ClusterResolver
from phalanx.cluster.spec import ClusterSpec
from phalanx.cluster.validation import parse_tf_config, validate_cluster


class TFConfigClusterResolver(ClusterResolver):
    """Reads and validates TF_CONFIG once, at construction.

    Explicit arguments override TF_CONFIG's ``task`` / ``rpc_layer`` / ``environment``. An unset
    or empty TF_CONFIG gives an empty cluster (a local run), as in TensorFlow.

    Args:
        task_type: overrides ``task.type``.
        task_id: overrides ``task.index``.
        rpc_layer: overrides the top-level ``rpc_layer``.
        environment: overrides the top-level ``environment``.
        environ: the environment to read (default ``os.environ``); for tests.

    Raises:
        ClusterSpecError: TF_CONFIG is malformed; the message names the key and value.

    Example:
        >>> import json
        >>> cfg = {"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
        ...        "task": {"type": "worker", "index": 1}}
        >>> r = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(cfg)})
        >>> r.task_type, r.task_id, r.master()
        ('worker', 1, 'w1:2222')
        >>> p = r.placement(local_world_size=2, local_rank=1)
        >>> p.rank, p.world_size, p.master_addr, p.describe_rank(0)
        (5, 6, 'c', 'chief:0 (rank 0)')
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
        cluster: dict = {}
        env_name = ""
        if text.strip():
            # A task given in code may stand in for TF_CONFIG's own, as TF allows.
            need_task = task_type is None or task_id is None
            cluster, cfg_type, cfg_id, cfg_rpc = parse_tf_config(text, require_task=need_task)
            task_type = cfg_type if task_type is None else task_type
            task_id = cfg_id if task_id is None else task_id
            rpc_layer = cfg_rpc if rpc_layer is None else rpc_layer
            env_name = _environment_of(text)
            validate_cluster(cluster, task_type, task_id)
        super().__init__(task_type, task_id, rpc_layer, env_name if environment is None else environment)
        self._cluster_spec = ClusterSpec(cluster)

    def cluster_spec(self) -> ClusterSpec:
        """The ``cluster`` part of TF_CONFIG (empty if TF_CONFIG is unset)."""
        return self._cluster_spec


def _environment_of(text: str) -> str:
    # parse_tf_config has already accepted this text, so loading it again cannot fail.
    value = json.loads(text).get("environment", "")
    return value if isinstance(value, str) else ""
