"""How many CPU cores this process may use, and the warning for more CPU replicas than that.

``phalanx run -n N`` and a script whose multi-replica strategy starts its own replicas warn in
the same words. More replicas than cores still train correctly (useful for testing), but they
share the cores and each synchronous step waits for the slowest. Imports no torch: the launcher
(``phalanx run``) never does.

Example:
    >>> from phalanx.launch.cores import cpu_oversubscription_warning, usable_cores
    >>> cpu_oversubscription_warning(usable_cores(), who="phalanx run", what="-n 2", fewer="-n {cores}") is None
    True
    >>> print(cpu_oversubscription_warning(usable_cores() + 1, who="phalanx", what="MirroredStrategy",
    ...                                    fewer="{cores} replica(s)"))  # doctest: +ELLIPSIS
    phalanx: warning: MirroredStrategy starts ... CPU replicas on ... core(s); they share cores ...
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_oversubscription_warning(replicas: int, *, who: str, what: str, fewer: str) -> str | None:
    """The warning for ``replicas`` CPU replicas on this host, or None when the cores suffice.

    Args:
        replicas: CPU replica processes the job runs on this host.
        who: the line's prefix: ``"phalanx run"``, ``"phalanx"``.
        what: what asked for them: ``"-n 3"``, ``"MirroredStrategy"``.
        fewer: the request that would fit, with ``{cores}`` for the core count: ``"-n {cores}"``.
    """
    cores = usable_cores()
    if replicas <= cores:
        return None
    return (
        f"{who}: warning: {what} starts {replicas} CPU replicas on {cores} core(s); they share cores and each "
        f"step waits for the slowest, so training is slower than with {fewer.format(cores=cores)}. Fine for "
        "testing; for speed use at most one replica per core."
    )
