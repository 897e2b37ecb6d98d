"""Pick the resolver that matches how this process was launched."""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.cluster.ray_train import RayTrainClusterResolver, ray_train_context
from phalanx.cluster.resolver import ClusterResolver
from phalanx.cluster.slurm import SlurmClusterResolver
from phalanx.cluster.tfconfig import TFConfigClusterResolver
from phalanx.cluster.torchelastic import TorchElasticClusterResolver


def _set(env: Mapping[str, str], *names: str) -> bool:
    return all(env.get(name, "").strip() for name in names)


def resolve_from_environment(environ: Mapping[str, str] | None = None) -> ClusterResolver | None:
    """The resolver for this launch, or ``None`` for a plain single-host run.

    TF_CONFIG wins (an explicit TF cluster), then Ray Train's context (a worker of a
    ``TorchTrainer``: Ray also sets torchrun's variables, and may run on Slurm), then torchrun's
    variables, then Slurm's. A Slurm step with one task is treated as a plain run: it is what
    ``srun --pty bash`` gives. Ray's context is read only for this process's own environment (an
    ``environ`` given describes another process).

    Raises:
        ClusterSpecError: the chosen environment is malformed.

    Example:
        >>> resolve_from_environment({}) is None
        True
        >>> type(resolve_from_environment({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h"})).__name__
        'TorchElasticClusterResolver'
    """
    env = os.environ if environ is None else environ
    if _set(env, "TF_CONFIG"):
        return TFConfigClusterResolver(environ=env)
    if environ is None and ray_train_context() is not None:
        return RayTrainClusterResolver()
    if _set(env, "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        return TorchElasticClusterResolver(environ=env)
    if _set(env, "SLURM_PROCID", "SLURM_NTASKS"):
        ntasks = env["SLURM_NTASKS"].strip()
        # A malformed count goes to the resolver so that the user gets its keyed error.
        if not ntasks.isdigit() or int(ntasks) > 1:
            return SlurmClusterResolver(environ=env)
    return None
