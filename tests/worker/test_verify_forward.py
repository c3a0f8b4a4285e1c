"""The speculative verify step in one forward (HybridModel.verify) is bitwise the per-position reference
(ModelRunner.verify_stepwise: one batched decode step per fed position): every logits row, every state buffer
of every slot, and every rollback copy a speculating slot keeps, for the dense and the MoE model, with and
without an MTP head, one slot and mixed batches, at positions right before a grid point, on the graph's fixed
(batch, width) layout too. Runs on the CPU in `make test`; the `gpu` tests on CUDA (graphs and eager)."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from capsulert.engine import runner as runner_module
from capsulert.engine.engine import GRID, Engine
from capsulert.engine.numerics import first_row_linear_variant, row_linear
from capsulert.engine.runner import MAX_DECODE_BATCH, verify_groups
from capsulert.engine.verify_rows import fixed_grid, step_inputs, verify_rows
from tests.models import MODELS


def prompt(n: int, salt: int) -> list[int]:
    return [(7 * j + 31 * salt) % 4000 + 1 for j in range(n)]


def verified(engine: Engine, lengths: list[int], fed: list[list[int]], one_forward: bool, layout=None):
    """Sessions of the given lengths fed `fed` in one verify step: their logits rows, every buffer of their
    slots (per-token rows up to where the step reached), and the rollback copies each speculating slot kept."""
    runner = engine.runner
    sessions = [engine.open() for _ in lengths]
    for i, (s, n) in enumerate(zip(sessions, lengths)):
        s.append(prompt(n, i))
    slots = [s.slot for s in sessions]
    runner.rollback.assign([s for s, f in zip(slots, fed) if len(f) > 1])
    for b in runner.rollback.buffers.values():
        b.zero_()
    was, runner.verify_in_one_forward = runner.verify_in_one_forward, one_forward
    if layout is None:
        rows = runner.verify(slots, fed)
    else:  # the model's forward on rows laid out as `layout` lays them
        plan = layout(slots, fed)
        logits = runner.model.verify(engine.state, plan, engine.config.max_seq, runner.rollback)
        starts = [plan.row_slots.tolist().index(s) for s in slots]
        rows = [logits[a:a + len(f)] for a, f in zip(starts, fed)]
    state = {}
    for s, n, f in zip(slots, lengths, fed):
        for name in engine.state.layout.shapes():
            view = engine.state.slot_view(name, s)
            state[s, name] = view[:, :n + len(f)] if name in engine.state.layout.block_tensors else view
    kept = {}
    for s, f in zip(slots, fed):
        for p in range(len(f) - 1):
            i = runner.rollback.set_of(s)
            kept.update({(s, name, p): b[i, p] for name, b in runner.rollback.buffers.items()})
    out = ([r.clone() for r in rows], {k: v.clone() for k, v in state.items()}, {k: v.clone() for k, v in kept.items()})
    for s in sessions:
        s.close()
    runner.verify_in_one_forward = was
    return out


def assert_same(got, want):
    (rows, state, kept), (want_rows, want_state, want_kept) = got, want
    assert len(rows) == len(want_rows)
    for a, b in zip(rows, want_rows):
        assert torch.equal(a, b)
    assert state.keys() == want_state.keys() and kept.keys() == want_kept.keys()
    for k in want_state:
        assert torch.equal(state[k], want_state[k]), k
    for k in want_kept:
        assert torch.equal(kept[k], want_kept[k]), k


# the step ends right before a grid point: positions 60..63, 124..127
ONE = ([GRID - 4], [[5, 6, 7, 8]])
MIXED = ([GRID - 4, 75, 2 * GRID - 4, 90], [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14]])


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("case", [ONE, MIXED], ids=["one", "mixed"])
def test_one_forward_equals_a_decode_step_per_position(make_engine, case):
    engine = make_engine(speculate_slots=3)
    assert engine.runner.verify_in_one_forward and engine.runner.has_mtp
    lengths, fed = case
    assert_same(verified(engine, lengths, fed, True), verified(engine, lengths, fed, False))


def test_without_an_mtp_head(default_model_dir, device, tmp_path):
    path = tmp_path / "no-mtp"
    shutil.copytree(default_model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(path / "model.safetensors"))
    engine = Engine.from_config(dict(model=str(path), device=device, slots=4, max_seq=512, prefill_chunk=128,
                                     speculate_slots=3))
    assert not engine.runner.has_mtp
    for lengths, fed in (ONE, MIXED):
        assert_same(verified(engine, lengths, fed, True), verified(engine, lengths, fed, False))


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_the_fixed_grid_layout_equals_the_exact_rows(make_engine):
    """The rows a captured graph replays (fixed_grid: every slot `width` rows, the missing ones and the missing
    slots in the scratch slot, every slot keeping to a set) give each slot the exact rows' bits."""
    engine = make_engine(speculate_slots=3)
    runner = engine.runner
    lengths, fed = MIXED
    dev = engine.device

    def grid(slots, f):
        return fixed_grid(slots, f, 6, 4, runner.scratch_slot, runner.rollback.set_of, runner.rollback.scratch, dev)

    def exact(slots, f):
        return verify_rows(slots, f, runner.rollback.set_of, dev)
    assert_same(verified(engine, lengths, fed, True, grid), verified(engine, lengths, fed, True, exact))
    assert_same(verified(engine, lengths, fed, True, grid), verified(engine, lengths, fed, False))


def test_more_rows_than_one_forward_holds_run_in_groups(make_engine):
    n = MAX_DECODE_BATCH // 4 + 1  # 4 fed tokens each: one row past one forward
    engine = make_engine(slots=n, speculate_slots=n, max_seq=256)
    lengths = [10 + i for i in range(n)]
    fed = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(n)]
    assert len(verify_groups(fed)) == 2
    assert_same(verified(engine, lengths, fed, True), verified(engine, lengths, fed, False))


def test_verify_groups_hold_at_most_a_decode_batch_of_rows():
    fed = [[1] * k for k in (4, 1, 3, 2) * 10]
    groups = verify_groups(fed)
    assert [i for g in groups for i in g] == list(range(len(fed)))
    assert all(sum(len(fed[i]) for i in g) <= MAX_DECODE_BATCH for g in groups)
    assert len(groups) == 2  # 100 rows: 64 fit the first


def test_verify_rows_layout():
    rows = verify_rows([3, 1, 2], [[10, 11, 12], [20], [30, 31]], {3: 0, 2: 1}.get, torch.device("cpu"))
    assert rows.tokens.tolist() == [10, 11, 12, 20, 30, 31]
    assert rows.row_slots.tolist() == [3, 3, 3, 1, 2, 2]
    assert rows.offsets.tolist() == [0, 1, 2, 0, 0, 1]
    assert rows.prev_rows.tolist() == [0, 0, 1, 3, 4, 4]
    assert [w.tolist() for w in rows.waves] == [[0, 3, 4], [1, 5], [2]]
    assert [None if k is None else (k[0].tolist(), k[1].tolist()) for k in rows.keeps] == [([0, 4], [0, 1]), ([1], [0]), None]
    assert rows.last_rows.tolist() == [2, 3, 5] and rows.counts.tolist() == [3, 1, 2]
    grid = fixed_grid([3, 1], [[10, 11, 12], [20]], 3, 3, 9, {3: 0}.get, 5, torch.device("cpu"))
    assert grid.row_slots.tolist() == [3, 3, 3, 1, 9, 9, 9, 9, 9]
    assert grid.tokens.tolist() == [10, 11, 12, 20, 0, 0, 0, 0, 0]
    assert [w.tolist() for w in grid.waves] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert [k[1].tolist() for k in grid.keeps[:2]] == [[0, 5, 5], [0, 5, 5]] and grid.keeps[2] is None
    assert grid.slots.tolist() == [3, 1, 9] and grid.last_rows.tolist() == [2, 3, 6]
    assert grid.counts.tolist() == [3, 1, 0]


def test_a_graph_step_copies_only_what_differs_between_steps_of_one_shape():
    """A verify graph's replay copies step_inputs alone into its static rows: every other tensor of two
    fixed grids of one shape, whatever they feed, is the same; copying step_inputs makes them equal."""
    cpu = torch.device("cpu")
    static = fixed_grid([], [], 4, 3, 9, lambda s: None, 5, cpu)  # what the graph was captured with
    new = fixed_grid([3, 1, 2], [[10, 11, 12], [20], [30, 31]], 4, 3, 9, {3: 0, 2: 1}.get, 5, cpu)
    for got, want in zip(step_inputs(static), step_inputs(new)):
        got.copy_(want)
    assert torch.equal(static.offsets, new.offsets) and torch.equal(static.prev_rows, new.prev_rows)
    assert all(torch.equal(a, b) for a, b in zip(static.waves, new.waves))
    for a, b in zip(static.keeps, new.keeps):
        assert (a is None) == (b is None)
        assert a is None or (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
    for f in ("tokens", "row_slots", "slots", "last_rows", "counts"):
        assert torch.equal(getattr(static, f), getattr(new, f)), f


def test_row_linear_gives_each_row_a_one_row_gemms_bits():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 256, generator=g)
    x = torch.randn(5, 1, 256, generator=g)
    assert torch.equal(row_linear(x, w), torch.stack([torch.nn.functional.linear(x[r], w) for r in range(5)]))
    assert first_row_linear_variant([w, w.t().contiguous()], 8) is None


def test_a_cpu_whose_batched_gemm_differs_verifies_per_position(make_engine, monkeypatch, caplog):
    monkeypatch.setattr(runner_module, "first_row_linear_variant", lambda weights, rows: (384, 256))
    engine = make_engine(device="cpu", speculate_slots=3)  # the CPU's choice: CUDA verifies in one forward always
    assert not engine.runner.verify_in_one_forward
    assert "one decode step per position" in caplog.text
    calls = []
    monkeypatch.setattr(engine.runner.model, "verify", lambda *a, **k: calls.append(a))
    lengths, fed = ONE
    rows = verified(engine, lengths, fed, False)[0]
    assert not calls and rows[0].shape[0] == 4


def test_a_step_of_plain_slots_only_needs_no_rollback_set(make_engine):
    engine = make_engine(speculate_slots=0)
    lengths, fed = [70, 80], [[3], [4]]
    assert_same(verified(engine, lengths, fed, True), verified(engine, lengths, fed, False))


@pytest.mark.gpu
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_one_forward_equals_a_decode_step_per_position(make_engine, graphs):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    engine = make_engine(device="cuda", slots=8, speculate_slots=8, cuda_graphs=graphs)
    for lengths, fed in (ONE, MIXED, ([GRID - 3] * 8, [[i, i + 1, i + 2] for i in range(8)])):
        assert_same(verified(engine, lengths, fed, True), verified(engine, lengths, fed, False))


def test_every_verify_shape_up_to_the_verify_batch_has_a_graph_and_room_for_its_rows(make_engine, monkeypatch):
    """A verify step of 8 slots fed 4 tokens each is 32 rows: the graphs' output held only the largest decode
    batch's rows (8), so those shapes were left out and an 8-session speculating batch ran eagerly (1.13x
    plain decode's time per token at 100% acceptance, H100). Padded decode steps (decode_rows R) bound a verify
    step to R rows, as the shapes past R would compute other bits than decode's R-row GEMMs."""
    from capsulert.engine.graphs import VERIFY_BATCH, GraphPlans, ShapeKey
    from capsulert.protocol.sampling import MAX_SPECULATE

    eng = make_engine(device="cpu", slots=8)
    monkeypatch.setattr(eng.model, "decode_rows", None)
    plans = GraphPlans(eng.model, eng.state, eng.runner.scratch_slot, eng.config.max_seq, eng.chunk, (1, 2, 4, 8),
                       eng.grid, rollback=eng.runner.rollback)
    widths = range(2, MAX_SPECULATE + 2)
    assert plans.verify_shapes == [(b, w) for b in (1, 2, 4, 8) if b <= VERIFY_BATCH for w in widths]
    assert plans.logits.shape[0] == 8 * (MAX_SPECULATE + 1)
    plans.warm_inputs()
    plans.run_shape(ShapeKey("verify", 8, MAX_SPECULATE + 1))  # its rows fit the output
    monkeypatch.setattr(eng.model, "decode_rows", 16)
    padded = GraphPlans(eng.model, eng.state, eng.runner.scratch_slot, eng.config.max_seq, eng.chunk, (1, 2, 4, 8),
                        eng.grid, rollback=eng.runner.rollback)
    assert padded.verify_shapes == [(b, w) for b in (1, 2, 4, 8) for w in widths if b * w <= 16]
