"""The core API (layer 2 of docs/ARCHITECTURE.md): what every strategy is built on.

* :mod:`~phalanx.core.strategy`: ``Strategy``, ``StrategyExtended`` (the contract the rest of
  phalanx relies on), ``DefaultStrategy`` and the extension points integrations join;
* :mod:`~phalanx.core.context`: the scope stack, ``ReplicaContext`` and ``merge_call``;
* :mod:`~phalanx.core.capture`, :mod:`~phalanx.core.distributed_variable`: capturing the
  variables created in ``scope()``; ``phalanx.Variable`` and TF's aggregation rules;
* :mod:`~phalanx.core.losses` (public as ``phalanx.nn``), :mod:`~phalanx.core.regroup`,
  :mod:`~phalanx.core.process`, :mod:`~phalanx.core.compiled`,
  :mod:`~phalanx.core.options`, :mod:`~phalanx.core.global_strategy`,
  :mod:`~phalanx.core.integrations`.

A strategy's ``extended`` owns the communicator, the replica's device and the variables; what it
does with them is done by collaborators it holds and names:

* :class:`~phalanx.core.cross_replica.CrossReplicaValues` (``extended.cross_replica``): the
  collectives on values (``reduce``, ``gather``, local results, ``ReplicaContext.all_reduce``)
  and TF's regroup check that the replicas' ``run`` results have one structure;
* :class:`~phalanx.core.consistency.ConsistencyChecks` (``extended.consistency``): the switch of
  the consistency guard (``set_consistency_checks``) and what the guard reads each step;
* :class:`~phalanx.core.variable_sync.VariableSync` (``extended.variable_sync``): the variables
  created under the strategy, what is still to broadcast, and the first step's watch for a
  parameter no scope saw.

The collaborators do not import :mod:`phalanx.core.strategy`: the extended passes what each needs.
``phalanx.compiled`` is a public alias of :mod:`phalanx.core.compiled` (``phalanx/__init__.py``).
"""
