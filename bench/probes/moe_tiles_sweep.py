"""Probe: launch constants of the MoE expert GEMMs at decode sizes (35B-A3B layer shape, bf16). For 1 / 8 / 32 /
64 tokens (random routing, top-8 of 256, and the shared expert), moe_experts under candidate gate/up and down tiles
and shared-expert rows per program, timed as CUDA-graph
replays over 8 layers' weights in turn (so a batch-1 step's 48 MB of experts does not sit in L2 between
replays), each checked bitwise against the current SMALL tiles. Writes moe_tiles_sweep.json to $OUT.

    python bench/probes/moe_tiles_sweep.py"""
import dataclasses
import itertools
import json
import os

import torch

from capsulert.engine.numerics import configure_cuda
from capsulert.kernels import triton_moe
from capsulert.kernels.moe import ExpertWeights
from capsulert.kernels.triton_moe import SMALL

configure_cuda()
E, H, I, K, LAYERS = 256, 2048, 512, 8, 8
dev, dt = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
w_gu = [(torch.randn(E, 2 * I, H, generator=g, device=dev) * H ** -0.5).to(dt) for _ in range(LAYERS)]
w_dn = [(torch.randn(E, H, I, generator=g, device=dev) * I ** -0.5).to(dt) for _ in range(LAYERS)]
# the shared expert: the last routed expert's weights (its shapes; views, no copy)
experts = [ExpertWeights(gu, dn, gu[E - 1, :I], gu[E - 1, I:], dn[E - 1]) for gu, dn in zip(w_gu, w_dn)]

GATE_UP = [dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=3), dict(BM=16, BN=16, BK=128, num_warps=4, num_stages=4),
           dict(BM=16, BN=16, BK=256, num_warps=4, num_stages=3), dict(BM=16, BN=32, BK=256, num_warps=4, num_stages=3),
           dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=5), dict(BM=16, BN=16, BK=128, num_warps=2, num_stages=4),
           dict(BM=16, BN=32, BK=64, num_warps=4, num_stages=6), dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3),
           dict(BM=16, BN=16, BK=64, num_warps=2, num_stages=6), dict(BM=16, BN=32, BK=128, num_warps=8, num_stages=4),
           dict(BM=16, BN=16, BK=256, num_warps=8, num_stages=4), dict(BM=16, BN=32, BK=256, num_warps=8, num_stages=4)]
SHARED_ROWS = (16, 64)  # the shared expert's rows per program
DOWN = [dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=3), dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=3),
        dict(BM=16, BN=32, BK=256, num_warps=4, num_stages=2), dict(BM=16, BN=64, BK=256, num_warps=4, num_stages=2),
        dict(BM=16, BN=128, BK=128, num_warps=4, num_stages=3), dict(BM=16, BN=32, BK=64, num_warps=2, num_stages=4),
        dict(BM=16, BN=16, BK=128, num_warps=2, num_stages=4), dict(BM=16, BN=64, BK=64, num_warps=4, num_stages=4),
        dict(BM=16, BN=32, BK=128, num_warps=8, num_stages=3), dict(BM=16, BN=64, BK=128, num_warps=8, num_stages=3)]


def problem(n):
    x = torch.randn(n, H, generator=g, device=dev).to(dt)
    logit = torch.randn(n, 1, generator=g, device=dev)
    wts, ids = torch.softmax(torch.randn(n, E, generator=g, device=dev), dim=-1).topk(K, dim=-1)
    wts = wts / wts.sum(dim=-1, keepdim=True)
    return x, ids, wts, logit


def run(p, tiles, layer):
    x, ids, wts, logit = p
    return triton_moe.moe_experts(x, ids, wts, experts[layer], logit, tiles=tiles)


def time_us(p, tiles, reps=20):
    for layer in range(LAYERS):
        run(p, tiles, layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            run(p, tiles, layer)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / LAYERS


res = {}
for n in (1, 8, 32, 64):
    p = problem(n)
    refs = [run(p, SMALL, layer) for layer in range(LAYERS)]
    row = {"small_us": round(time_us(p, SMALL), 2), "gate_up": [], "down": []}
    for kind, cands in (("gate_up", GATE_UP), ("down", DOWN)):
        for c, shared_rows in itertools.product(cands, SHARED_ROWS):
            tiles = dataclasses.replace(SMALL, **{kind: c}, shared_rows=shared_rows)
            same = all(torch.equal(run(p, tiles, layer), refs[layer]) for layer in range(LAYERS))
            row[kind].append({"tiles": c, "shared_rows": shared_rows, "us": round(time_us(p, tiles), 2),
                              "bitwise": same})
    res[n] = row
    best = {k: min(row[k], key=lambda r: r["us"]) for k in ("gate_up", "down")}
    print(f"n={n}: SMALL {row['small_us']} us/layer; best gate_up {best['gate_up']}; best down {best['down']}",
          flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "moe_tiles_sweep.json"), "w"), indent=1)
