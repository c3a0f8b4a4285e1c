"""Probe: how a decode step's attention should split its keys. The split count must not follow the batch size
(batch invariance), so one rule serves b = 1 and b = 64. Times attention() (graph replays over 10 layers' KV, as
a step runs them) at b = 1 / 8 / 64 and contexts 2k / 16k, max_seq 17k, for the current rule (a fixed count of
proportional splits, sized to fill the GPU for one row) and for absolute key ranges of 128 / 256 / 512 keys
(ordered merge). Shapes of the 35B-A3B (Hq 16, Hkv 2, D 256) and 9B (Hkv 4) attention. Writes
decode_attention_splits.json to $OUT.

    python bench/probes/decode_attention_splits.py"""
import json
import os

import torch

from capsulert.kernels import triton_attention as ta

base_config = ta._launch_config
RULES = {"current": None, "abs128": 128, "abs256": 256, "abs512": 512}


def with_rule(keys):
    def config(B, T, Hq, Hkv, D, kv_len, device, fp32=False, split_invariant=False):
        cfg = base_config(B, T, Hq, Hkv, D, kv_len, device, fp32=fp32, split_invariant=split_invariant)
        if keys is not None and not split_invariant:
            cfg = dict(cfg, splits=triton.cdiv(kv_len, keys), split_keys=keys)
        return cfg
    return config


import triton  # noqa: E402

LAYERS, MAX_SEQ, D, Hq = 10, 17408, 256, 16  # 10 layers' own KV: a layer's keys are not in L2 from the last
res = {}
for Hkv in (2, 4):
    slots_n = 64
    kv = [tuple(torch.empty(slots_n, MAX_SEQ, Hkv, D, device="cuda", dtype=torch.bfloat16).normal_() for _ in "kv")
          for _ in range(LAYERS)]
    for ctx in (2048, 16384):
        for B in (1, 8, 64):
            q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)
            slots = torch.arange(B, device="cuda")
            start = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
            row = {}
            for name, keys in RULES.items():
                ta._launch_config = with_rule(keys)
                try:
                    def step():
                        for layer in range(LAYERS):
                            k, v = kv[layer]
                            ta.attention(q, k, v, slots, start, MAX_SEQ, D ** -0.5)
                    step()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        step()
                    g.replay()
                    torch.cuda.synchronize()
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    for _ in range(20):
                        g.replay()
                    t1.record()
                    torch.cuda.synchronize()
                    row[name] = round(t0.elapsed_time(t1) / 20 / LAYERS * 1e3, 2)  # us per layer
                finally:
                    ta._launch_config = base_config
            res[f"hkv{Hkv}_ctx{ctx}_b{B}"] = row
            print(f"Hkv={Hkv} ctx={ctx} b={B}: us/layer {row}", flush=True)
    del kv
    torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "decode_attention_splits.json"), "w"), indent=1)
