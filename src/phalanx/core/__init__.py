"""The collaborators of :class:`phalanx.strategy.StrategyExtended`, each with one responsibility.

A strategy's ``extended`` owns the communicator, the replica's device and the variables; what it
does with them is done here, by objects it holds and names:

* :class:`~phalanx.core.cross_replica.CrossReplicaValues` (``extended.cross_replica``): the
  collectives on values (``reduce``, ``gather``, local results, ``ReplicaContext.all_reduce``)
  and TF's regroup check that the replicas' ``run`` results have one structure;
* :class:`~phalanx.core.consistency.ConsistencyChecks` (``extended.consistency``): the switch of
  the consistency guard (``set_consistency_checks``) and what the guard reads each step;
* :class:`~phalanx.core.variable_sync.VariableSync` (``extended.variable_sync``): the variables
  created under the strategy, what is still to broadcast, and the first step's watch for a
  parameter no scope saw.

Nothing here imports :mod:`phalanx.strategy`: the extended passes what each needs.
"""
