"""Canonical state on the 64-token grid, whatever the prefill pieces: split-invariant prefill (pieces of
any size that start on the grid give bitwise the same state at every grid point and the same logits), a
capsule or session that ends anywhere re-runs fewer than 64 tokens, and decode that crosses grid points in a
batch re-derives them together, bitwise as alone."""
from __future__ import annotations

import random

import pytest
import torch

from capsulert.capsule_store.capsule import CapsuleMeta
from capsulert.capsule_store.format.meta import meta_from_json, meta_to_json
from capsulert.errors import IncompatibleCapsuleError
from capsulert.engine.engine import GRID, grid_point_inside, prefill_pieces
from capsulert.engine.state import LAYOUT_VERSION
from capsulert.protocol.sampling import SamplingParams
from tests.worker.pieces import count_pieces

NOEOS = SamplingParams(ignore_eos=True)


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


def state_of(eng, s) -> dict[str, torch.Tensor]:
    """The slot's complete state (copies): KV rows [0, P), live and grid recurrent/conv state, last hidden and,
    with an MTP head, the head's KV rows [1, P) (row 0 holds no entry and is never read)."""
    P, st = len(s.tokens), eng.state
    out = {"kv_k": st.kv_k[:, s.slot, :P].clone(), "kv_v": st.kv_v[:, s.slot, :P].clone(),
           "ssm": st.ssm[:, s.slot].clone(), "conv": st.conv[:, s.slot].clone(),
           "ssm_grid": st.ssm_grid[:, s.slot].clone(), "conv_grid": st.conv_grid[:, s.slot].clone(),
           "last_hidden": st.last_hidden[s.slot].clone(), "pos": st.pos[s.slot].clone()}
    if st.layout.mtp_layers:
        out.update(mtp_k=st.mtp_k[:, s.slot, 1:P].clone(), mtp_v=st.mtp_v[:, s.slot, 1:P].clone())
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("start,end,chunk,want", [
    (0, 300, 128, [(0, 128), (128, 256), (256, 300)]),
    (0, 200, 1024, [(0, 200)]),
    (192, 200, 1024, [(192, 200)]),
    (64, 1100, 1024, [(64, 1088), (1088, 1100)]),
    (3008, 3103, 1024, [(3008, 3103)]),
    (0, 256, 128, [(0, 128), (128, 256)]),
    (128, 130, 128, [(128, 130)]),
], ids=["chunks+tail", "grid-inside", "tail-only", "from-grid", "across-a-chunk", "on-grid", "short"])
def test_prefill_pieces_are_chunks_from_where_they_start(start, end, chunk, want):
    assert prefill_pieces(start, end, chunk) == want


SIZES_4096 = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]  # the graphs' token buckets under 4096-token pieces


@pytest.mark.parametrize("start,end,chunk,sizes,want", [
    (0, 2080, 4096, SIZES_4096, [(0, 2048), (2048, 2080)]),
    (0, 3032, 4096, SIZES_4096, [(0, 2048), (2048, 3032)]),
    (64, 2200, 4096, SIZES_4096, [(64, 2112), (2112, 2200)]),
    (0, 8224, 4096, SIZES_4096, [(0, 4096), (4096, 8192), (8192, 8224)]),
    (0, 2048, 4096, SIZES_4096, [(0, 2048)]),
    (0, 600, 1024, SIZES_4096[:7], [(0, 600)]),
    (0, 1100, 1536, [16, 32, 64, 128, 256, 512, 1024, 1536], [(0, 1100)]),
    (0, 4100, 4096, SIZES_4096, [(0, 4096), (4096, 4100)]),
], ids=["rest-cut", "rest-cut-then-pad", "from-grid", "chunks-then-rest", "whole-bucket", "small-waste-padded",
        "chunk-not-a-power-of-2", "short-rest"])
def test_a_rest_its_graph_would_pad_by_over_a_quarter_is_cut_at_the_largest_size_that_fits(start, end, chunk, sizes, want):
    pieces = prefill_pieces(start, end, chunk, sizes)
    assert pieces == want
    assert all(a % GRID == 0 for a, _ in pieces)  # on the grid: split-invariant prefill keeps their bits


@pytest.mark.parametrize("a,b,want", [(0, 200, 192), (2944, 3032, 64), (192, 200, None), (0, 256, None),
                                      (64, 1100, 1024), (3008, 3071, None)])
def test_the_last_grid_point_inside_a_piece(a, b, want):
    assert grid_point_inside(a, b) == want


@pytest.mark.parametrize("P,n", [(120, 40), (191, 32), (100, 140), (130, 62), (250, 20)])
def test_a_piece_that_crosses_its_grid_point_keeps_the_checkpoint_in_one_pass(make_engine, P, n, monkeypatch):
    """An append past a grid point runs as one piece (one pass of the weights, not one up to the grid point
    and one past it), and the grid checkpoint it keeps inside the piece is bitwise the state a prefill that
    stops at the grid point computes, as are the live state and the logits after it, and the hidden state
    before the grid point (the logits a checkpoint there gives)."""
    eng = make_engine(prefill_chunk=256, slots=3, tail_replay=True)
    t = toks(P + n, 6)
    G = (P + n) // GRID * GRID
    cut = eng.open()
    cut.append(t[:G])
    at_grid = state_of(eng, cut)
    cut.close()
    s = eng.open()
    s.append(t[:P])
    with monkeypatch.context() as m:
        passes = count_pieces(eng, m)
        got = s.append(t[P:]).clone()
    # the new tokens in one piece, the tail [P // GRID * GRID, P) replayed in its linear-attention layers
    assert passes == [n], passes
    mine = state_of(eng, s)
    for k in ("ssm", "conv"):
        assert torch.equal(mine[f"{k}_grid"], at_grid[k]), f"{k} checkpoint at {G}"
    if P + n > G:  # crossed inside the piece (on the grid, last_hidden is that hidden state: compared below)
        assert torch.equal(eng.state.grid_hidden[s.slot], at_grid["last_hidden"]), f"hidden state before {G}"
    cold = eng.open()
    want = cold.append(t).clone()
    assert torch.equal(got, want)
    assert_same(state_of(eng, cold), mine, f"append at {P} + {n}")


def test_prefill_in_any_pieces_gives_the_same_state_at_every_grid_point(make_engine):
    """Cold prefill of tokens[:G] (pieces of the prefill chunk) vs the same tokens appended in pieces of 64 and
    in random 64-aligned and unaligned appends: bitwise the same complete state and logits, at every G."""
    big, small = make_engine(prefill_chunk=256, slots=3), make_engine(prefill_chunk=64, slots=3)
    t = toks(640, 1)
    rng = random.Random(0)
    for G in range(GRID, 641, GRID):
        ref = big.open()
        want_logits = ref.append(t[:G]).clone()
        want = state_of(big, ref)
        ref.close()
        for eng, how in ((small, "pieces of 64"), (big, "random appends")):
            s = eng.open()
            if how == "random appends":
                cuts = sorted(rng.sample(range(1, G), min(3, G - 1)))
                for a, b in zip([0] + cuts, cuts + [G]):
                    got_logits = s.append(t[a:b])
            else:
                got_logits = s.append(t[:G])
            assert torch.equal(got_logits, want_logits), f"G={G} {how}: logits"
            assert_same(want, state_of(eng, s), f"G={G} {how}")
            s.close()


@pytest.mark.parametrize("P", [130, 191, 192, 250, 383])
def test_a_capsule_anywhere_runs_only_the_new_tokens(make_engine, P, monkeypatch):
    """A capsule of a prompt ending anywhere: restore + append runs the 32 new tokens through the model (the
    fewer than 64 tokens past its grid point are replayed from the capsule's tail rows) and equals a cold
    prefill bitwise."""
    eng = make_engine(prefill_chunk=128, tail_replay=True)
    t = toks(P + 32, 2)
    s = eng.open()
    s.append(t[:P])
    s.snapshot("c")
    s.close()
    cold = eng.open()
    want = cold.append(t).clone()
    want_state = state_of(eng, cold)
    cold.close()
    r = eng.restore("c")
    ran = count_pieces(eng, monkeypatch)
    got = r.append(t[P:])
    assert torch.equal(got, want)
    assert_same(want_state, state_of(eng, r), f"restore at {P} + append")
    assert sum(ran) == 32, f"ran {sum(ran) - 32} old tokens at P={P}"


def test_sessions_crossing_a_grid_point_in_one_step_rederive_together_bitwise_as_alone(make_engine):
    eng = make_engine(prefill_chunk=128, slots=4)
    prompts = [toks(50, 10 + i) for i in range(3)]  # decode crosses the grid points 64 and 128
    solo = []
    for p in prompts:
        s = eng.open()
        s.append(p)
        solo.append((list(s.generate(80, NOEOS)), state_of(eng, s)))
        s.close()
    calls = []
    rederive = eng.table.rederive_grid_points
    eng.table.rederive_grid_points = lambda ss, *riding: (calls.append(len(ss)), rederive(ss, *riding))[1]
    sessions = [eng.open() for _ in prompts]
    for s, p in zip(sessions, prompts):
        s.append(p)
    outs = eng.generate(sessions, 80, [NOEOS] * 3)
    assert calls == [3, 3], calls  # one batched re-derivation for each grid point the three crossed together
    for (want_tokens, want_state), out, s in zip(solo, outs, sessions):
        assert list(out) == want_tokens
        assert_same(want_state, state_of(eng, s), "batched re-derivation")


def test_restore_and_append_after_generate_equals_cold_prefill(make_engine):
    eng = make_engine(prefill_chunk=128)
    s = eng.open()
    s.append(toks(100, 3))
    s.generate(90, NOEOS)  # crosses 128 and 192 while decoding
    s.snapshot("g")
    tail = toks(20, 4)
    r = eng.restore("g")
    got = r.append(tail)
    cold = eng.open()
    want = cold.append(list(s.tokens) + tail)
    assert torch.equal(got, want)
    assert_same(state_of(eng, cold), state_of(eng, r), "after generate")


def test_capsule_of_the_previous_layout_reads_its_grid_and_is_refused(make_engine, tmp_path, monkeypatch):
    meta = CapsuleMeta.build(name="old", tokens=list(range(300)), grid_pos=256, fingerprint="fp", layout_version=2,
                             grid=128, nbytes=1)
    legacy = meta_to_json(meta).replace('"grid":128', '"prefill_chunk":128')  # what layout 2 wrote
    assert '"prefill_chunk"' in legacy and meta_from_json(legacy) == meta
    with monkeypatch.context() as m:  # an engine of the previous layout saves a capsule
        m.setattr("capsulert.engine.capsules.LAYOUT_VERSION", 2)
        old = make_engine()
        s = old.open()
        s.append(toks(150, 5))
        s.snapshot("v2")
        old.store.save(tmp_path / "v2")
        old.close()
    eng = make_engine()
    with pytest.raises(IncompatibleCapsuleError, match=f"layout version 2, this build uses {LAYOUT_VERSION}"):
        eng.store.load(tmp_path / "v2")
    assert eng.store.list() == []


def test_a_cpu_piece_runs_on_whole_row_multiples(make_engine, monkeypatch):
    """CPU kernels give a row other bits at a few rows (gemv) or a ragged tail (scalar code), so every CPU
    prefill piece is padded to whole cpu_piece_rows (the first of 8/16/32/64 at which this machine's BLAS keeps
    a row's bits: 8 on most, 16 on a 16-thread Xeon), the padding writing no state (valid)."""
    from capsulert.engine.numerics import cpu_piece_rows
    from capsulert.engine.runner import probe_weight

    eng = make_engine(device="cpu", prefill_chunk=128)
    p = eng.runner.cpu_piece_rows
    assert p == cpu_piece_rows(probe_weight(eng.model_weights, eng.model_cfg))
    shapes = []
    forward = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a, **k: (shapes.append(
        (a[2].shape[1], None if k.get("valid") is None else int(k["valid"][0]))), forward(*a, **k))[1])
    s = eng.open()
    s.append(toks(449, 7))
    # [384, 449): 65 real rows in whole multiples of p
    assert shapes == [(128, None), (128, None), (128, None), (-(-65 // p) * p, 65)], shapes
    assert int(eng.state.pos[s.slot]) == 449


def _gemm_rounding_otherwise(monkeypatch, odd) -> None:
    """F.linear as a BLAS whose GEMMs of `odd(rows)` rows round otherwise."""
    import torch.nn.functional as F

    real = F.linear

    def linear(x, w, *args):
        out = real(x, w, *args)
        return out * (1 + 2 ** -20) if odd(x.shape[0]) else out
    monkeypatch.setattr(F, "linear", linear)


def test_a_cpu_whose_8_row_pieces_change_a_rows_bits_pads_its_pieces_to_16(make_engine, monkeypatch, caplog):
    """A BLAS that keeps a row's bits only in whole 16-row multiples (a 16-thread Xeon's kept them in none of
    8 rows): the engine pads every CPU piece to 16 rows, says so, and a capsule still equals a cold prefill."""
    from capsulert.engine.numerics import cpu_pieces

    assert any(m % 16 for _, m in cpu_pieces(8)) and not any(m % 16 for _, m in cpu_pieces(16))
    _gemm_rounding_otherwise(monkeypatch, lambda rows: rows % 16 != 0)
    with caplog.at_level("INFO", logger="capsulert.engine"):
        eng = make_engine(device="cpu", prefill_chunk=128)
    assert eng.runner.cpu_piece_rows == 16 and "whole 16-row multiples" in caplog.text
    rows = []
    forward = eng.model.forward
    monkeypatch.setattr(eng.model, "forward", lambda *a, **k: (rows.append(a[2].shape[1]), forward(*a, **k))[1])
    prompt = toks(200, 11)
    s = eng.open()
    s.append(prompt[:150])
    eng.snapshot(s, "c150")
    s.close()
    r = eng.restore("c150")
    got = r.append(prompt[150:])
    cold = eng.open()
    want = cold.append(prompt)
    assert torch.equal(got, want)
    assert rows and all(n % 16 == 0 for n in rows), rows


def test_a_cpu_whose_gemm_rows_depend_on_the_piece_is_refused_at_start(make_engine, monkeypatch):
    """The engine checks at start that this machine's BLAS gives a row the same bits in every piece a CPU prefill
    runs, at some whole number of rows it may pad pieces to: otherwise capsules could not be exact, and it says
    so."""
    from capsulert.engine.numerics import CPU_PIECE_ROWS_CHOICES, cpu_check_rows, cpu_pieces
    from capsulert.errors import ConfigError

    for rows in CPU_PIECE_ROWS_CHOICES:
        assert all(a % rows == 0 and m % rows == 0 for a, m in cpu_pieces(rows))
    full = {cpu_check_rows(r) for r in CPU_PIECE_ROWS_CHOICES}
    _gemm_rounding_otherwise(monkeypatch, lambda rows: rows not in full)  # only the one-GEMM references agree
    with pytest.raises(ConfigError, match="breaks split-invariant prefill"):
        make_engine(device="cpu")


CUDA_CAUSES = {torch.bfloat16: "before any other CUDA work", torch.float32: "dtype='bfloat16'"}


@pytest.mark.parametrize("dtype", list(CUDA_CAUSES), ids=str)
def test_a_gpu_whose_gemm_rows_depend_on_the_piece_is_told_why(monkeypatch, dtype):
    """The CUDA start check names the cause: for bf16 the process's cuBLAS settings (read at its first GEMM);
    for fp32, which cuBLAS does not compute row-invariantly (a one-row GEMM takes another kernel on the H200),
    the dtype."""
    from capsulert.engine.numerics import check_split_invariant_gemm
    from capsulert.errors import ConfigError

    import torch.nn.functional as F

    real = F.linear  # every piece of fewer rows than the one-GEMM reference rounds otherwise (by a bf16 ulp)
    monkeypatch.setattr(F, "linear", lambda x, w: real(x, w) * (1 if x.shape[0] == 1024 else 1 + 2 ** -6))
    w = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    with pytest.raises(ConfigError, match=str(dtype).replace("torch.", "")) as err:
        check_split_invariant_gemm(w)
    assert [c in str(err.value) for c in CUDA_CAUSES.values()] == [d == dtype for d in CUDA_CAUSES]
