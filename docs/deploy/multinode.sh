#!/bin/bash
# Two hosts without a cluster manager, torchrun-style: run this on each host.
#
#   NODE_RANK    0 on the first host, 1 on the second
#   MASTER_ADDR  the first host's address, reachable from the other (e.g. 10.0.0.1)
#
# phalanx run starts -n replica processes on this host (one per GPU, or CPU replicas) and the
# hosts meet at MASTER_ADDR:29500; every listener binds to the address that routes there.
set -euo pipefail
phalanx run --nnodes 2 --node-rank "$NODE_RANK" --master "$MASTER_ADDR:29500" -n 1 train.py --steps 30
