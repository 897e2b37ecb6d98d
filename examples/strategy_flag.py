"""The examples' one changed line: which strategy to run under, from ``--strategy``.

--strategy one_device        OneDeviceStrategy on the first GPU, else the CPU
--strategy mirrored          MirroredStrategy: every GPU, or --replicas CPU replicas on a host
                             without GPUs (the script starts the other replica processes itself)
--strategy central_storage   CentralStorageStrategy: one copy of the variables; the GPU, or
                             --replicas CPU replicas, compute
--strategy multi_worker      MultiWorkerMirroredStrategy; each worker runs the script with its
                             own TF_CONFIG (or under `phalanx run`, torchrun, Slurm)
--strategy parameter_server  ParameterServerStrategy (asynchronous); start the cluster with
                             `phalanx run --ps 2 --workers 2 SCRIPT --strategy parameter_server`
                             (ps and worker tasks serve inside the strategy line and exit there)
"""

import argparse

import torch

import phalanx


def strategy_from_flags(description: str = "") -> phalanx.Strategy:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--strategy",
        default="mirrored",
        choices=["one_device", "mirrored", "central_storage", "multi_worker", "parameter_server"],
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="CPU replicas of --strategy mirrored / central_storage on a host without GPUs (default 2)",
    )
    args = parser.parse_args()
    if args.strategy == "one_device":
        return phalanx.OneDeviceStrategy("/gpu:0" if torch.cuda.is_available() else "/cpu:0")
    if args.strategy == "multi_worker":
        return phalanx.MultiWorkerMirroredStrategy()
    if args.strategy == "parameter_server":
        return phalanx.ParameterServerStrategy()
    cpus = [f"cpu:{i}" for i in range(args.replicas)]
    if args.strategy == "central_storage":
        return phalanx.CentralStorageStrategy() if torch.cuda.is_available() else phalanx.CentralStorageStrategy(cpus)
    if torch.cuda.is_available():
        return phalanx.MirroredStrategy()
    return phalanx.MirroredStrategy(cpus)
