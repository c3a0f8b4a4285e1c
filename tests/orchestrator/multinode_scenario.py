"""A two-node Ray cluster on one machine, and an orchestrator that joins it by address.

`ray.cluster_utils.Cluster` starts two raylets, each with one CPU and a custom resource naming it
(node_a, node_b). The orchestrator joins by the cluster's address with two workers of one CPU each, so
Ray can only place one worker on each node. A capsule snapshotted on worker 0 is copied to worker 1
through the object store and through a directory both nodes read; the copies are compared with the
source. Prints one JSON line for tests/orchestrator/test_multinode.py.

It runs as its own process because a Cluster needs a Ray of its own: the test process already holds a
local Ray (tests/orchestrator/conftest.py), and a process connects to one Ray at a time.

    python tests/orchestrator/multinode_scenario.py --model DIR --shared-dir DIR
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
import ray
from ray.cluster_utils import Cluster

from capsulert.orchestrator import Orchestrator
from capsulert.protocol.requests import ExportCapsule

PROMPT = "Two nodes share the load; a capsule made on one continues on the other. "
NODES = ("node_a", "node_b")


def start_cluster() -> Cluster:
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={NODES[0]: 1}, include_dashboard=False))
    cluster.add_node(num_cpus=1, resources={NODES[1]: 1})
    cluster.wait_for_nodes()
    return cluster


def node_names() -> dict[str, str]:
    """Ray node id -> the custom resource that names it (read from the cluster, as the driver sees it)."""
    return {n["NodeID"]: next(r for r in NODES if r in n["Resources"]) for n in ray.nodes() if n["Alive"]}


async def scenario(address: str, model: str, shared_dir: str) -> dict:
    cfg = dict(engine=dict(model=model, device="cpu", slots=4, max_seq=512, prefill_chunk=128),
               address=address, num_workers=2, worker_num_cpus=1, torch_threads=1, call_timeout_s=60)
    async with await Orchestrator.start(cfg) as orch:
        names = node_names()
        worker_nodes = [names[h["node"]] for h in await orch.health()]

        a = await orch.open(PROMPT, worker=0)
        await a.snapshot("c0")
        b = await orch.open(" unrelated", worker=1)
        await b.restore("c0")  # worker 1 lacks c0: the router copies it through the object store
        via_store = sorted(orch.placement()["c0"])
        logits_equal = bool(np.array_equal(await a.append(" Next", logits=True), await b.append(" Next", logits=True)))
        ga, gb = await a.generate(8), await b.generate(8)
        export_equal = await orch.call(0, ExportCapsule("c0")) == await orch.call(1, ExportCapsule("c0"))

        await a.snapshot("c1")
        await orch.migrate("c1", 1, via="disk", directory=shared_dir)
        via_disk = sorted(orch.placement()["c1"])
        c = await orch.open(" other", worker=1)
        await c.restore("c1")
        gc, ga2 = await c.generate(8), await a.generate(8)
        return dict(
            worker_nodes=worker_nodes, via_store=via_store, via_disk=via_disk, logits_equal=logits_equal,
            export_equal=export_equal,
            store_tokens=[list(ga), list(gb)], store_logprobs=[ga.logprobs, gb.logprobs],
            disk_tokens=[list(ga2), list(gc)], disk_logprobs=[ga2.logprobs, gc.logprobs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (identical on every node)")
    p.add_argument("--shared-dir", required=True, help="a directory every node reads and writes")
    args = p.parse_args()
    t0 = time.monotonic()
    cluster = start_cluster()
    try:
        result = asyncio.run(scenario(cluster.address, args.model, args.shared_dir))
    finally:
        ray.shutdown()  # the orchestrator disconnected already; harmless when so
        cluster.shutdown()
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
