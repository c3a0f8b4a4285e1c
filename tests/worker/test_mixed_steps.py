"""A decode step whose sessions include some that reach a grid point: those are not decoded (their decode row
would be thrown away) but re-derive the grid point in the step, and on CUDA the other sessions' decode rows ride
in that forward (HybridModel.step_with_pieces: one pass of the weights). Every session's logits and every state
buffer of its slot are bitwise what decoding all of them and then re-deriving gives, and its later tokens are its
solo run's. Runs on the CPU in `make test` (the re-derivation without the wasted decode rows); on the GPU with
`--device cuda -m ""` (the mixed forward, in graphs and eagerly, and the fall-back past the captured counts)."""
import pytest
import torch

from capsulert.engine.engine import GRID
from capsulert.engine.numerics import first_mixed_variant_gemm
from capsulert.engine.runner import MAX_DECODE_BATCH
from capsulert.protocol.sampling import SamplingParams
from tests.models import MODELS
from tests.worker.test_append_many import assert_same, slot_bytes

NOEOS = SamplingParams(ignore_eos=True)


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 4096, (n,), generator=g).tolist()


def lengths(reaching: int) -> list[int]:
    """Six sessions' lengths: the first `reaching` one token short of a grid point, the others not."""
    on = [GRID - 1, 2 * GRID - 1, 3 * GRID - 1, GRID - 1, 2 * GRID - 1, 3 * GRID - 1]
    off = [GRID + 5, 10, 2 * GRID + 30, 40, GRID + 1, 2 * GRID + 2]
    return on[:reaching] + off[reaching:]


def open_all(eng, sizes: list[int]) -> list:
    return [eng.open(toks(n, 100 + i)) for i, n in enumerate(sizes)]


def reference_step(eng, sessions, tokens) -> torch.Tensor:
    """The step as every session decoded and those that reached a grid point then re-derived it: the decode
    rows of the latter thrown away."""
    logits = eng.runner.decode([s.slot for s in sessions], tokens)[:len(sessions)].clone()
    reached = []
    for r, (s, t) in enumerate(zip(sessions, tokens)):
        s.tokens.append(t)
        if len(s.tokens) % GRID == 0:
            reached.append(r)
    if reached:
        for r, row in zip(reached, eng.table.rederive_grid_points([sessions[r] for r in reached])):
            logits[r] = row
    return logits


def check_two_steps(eng, reaching: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Six sessions, `reaching` of them one token short of a grid point, take two steps (the second from the
    re-derived state). Each step's logits and each slot's state equal the reference's, and no decode row is
    computed for a session that reaches its grid point (the decode rows counted wherever they run: a decode
    step, an eager mixed forward or a mixed graph). Returns the (decode rows, pieces) of each eager mixed
    forward and of each mixed graph replay that ran."""
    sizes = lengths(reaching)
    ours, ref = open_all(eng, sizes), open_all(eng, sizes)
    decoded: list[list[int]] = []
    decode = eng.runner.decode
    eng.runner.decode = lambda slots, tokens: (decoded.append(list(slots)), decode(slots, tokens))[1]
    mixed: list[tuple[int, int]] = []
    step_with_pieces = eng.runner.model.step_with_pieces
    eng.runner.model.step_with_pieces = lambda state, slots, tokens, piece_slots, *a: (
        mixed.append((slots.shape[0], piece_slots.shape[0])), decoded.append(slots.tolist()),
        step_with_pieces(state, slots, tokens, piece_slots, *a))[-1]
    replayed: list[tuple[int, int]] = []
    graphs = eng.runner.graphs
    if graphs is not None:
        graph_mixed = graphs.mixed
        graphs.mixed = lambda slots, tokens, grid_slots, *a: (
            replayed.append((len(slots), len(grid_slots))), decoded.append(list(slots)),
            graph_mixed(slots, tokens, grid_slots, *a))[-1]
    try:
        for step in range(2):
            tokens = toks(len(sizes), 7 + step)
            decoded.clear()
            got = eng.table.step(ours, tokens).clone()
            assert sum(decoded, []) == [s.slot for s, t in zip(ours, tokens) if len(s.tokens) % GRID], (
                "a session that reached its grid point was decoded")
            want = reference_step(eng, ref, tokens)
            assert torch.equal(got[:len(sizes)], want)
            for a, b in zip(ours, ref):
                assert_same(eng, a, b)
    finally:
        del eng.runner.decode, eng.runner.model.step_with_pieces
        if graphs is not None:
            del graphs.mixed
    return mixed, replayed


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("reaching", [1, 3, 5, 6])
def test_a_step_re_derives_the_sessions_at_a_grid_point_bitwise_as_decoding_all_of_them(make_engine, device,
                                                                                          reaching):
    """On CUDA the first step is one forward, in the captured (mixed, decode batch, pieces) graph, for up to
    four re-derivations (mixed_rederive_pieces (1, 2, 4)); five run as two forwards, six (no decode row) as one."""
    eng = make_engine(slots=12, max_seq=512, mixed_rederive_pieces=(1, 2, 4))
    # CUDA mixes where every GEMM keeps a row's bits at the step's row counts (the start-up check); the CPU never
    exact = eng.model.decode_rows is None and first_mixed_variant_gemm(eng.model.gemm_weights(), MAX_DECODE_BATCH,
                                                                       GRID * 4) is None
    assert eng.runner.mixed_steps == (device == "cuda" and exact)
    eager, replayed = check_two_steps(eng, reaching)
    assert eager == []  # on CUDA the mixed forward ran inside its graph
    assert replayed == ([(6 - reaching, reaching)] if eng.runner.mixed_steps and reaching <= 4 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
@pytest.mark.parametrize("reaching", [1, 3, 5])
def test_an_eager_cuda_step_runs_its_re_derivations_and_decode_rows_in_one_forward(make_engine, reaching):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device: run with -m gpu --device cuda on the GPU machine")
    eng = make_engine(device="cuda", slots=12, max_seq=512, cuda_graphs=False, mixed_rederive_pieces=(4,))
    assert eng.runner.mixed_steps, "this GPU's GEMMs give a row other bits at the mixed step's row counts"
    # without graphs up to the largest count rides in the step; more run as two forwards
    assert check_two_steps(eng, reaching) == ([(6 - reaching, reaching)] if reaching <= 4 else [], [])


@pytest.mark.parametrize("model_dir", MODELS, indirect=True)
def test_a_crowd_decoding_past_grid_points_at_different_steps_keeps_each_sessions_solo_tokens(make_engine):
    """Three sessions of different lengths generate together past their grid points, reaching them at
    different steps (a step re-derives one while the others decode: 64 at the 3rd and 14th, 128 at the 29th and
    67th); each session's tokens and final state are its solo run's."""
    eng = make_engine(slots=4, max_seq=512)
    prompts = [toks(n, 30 + i) for i, n in enumerate((50, 61, 99))]
    solo = []
    for p in prompts:
        s = eng.open(p)
        solo.append(list(s.generate(70, NOEOS)))
        solo.append(slot_bytes(eng, s))
        s.close()
    sessions = [eng.open(p) for p in prompts]
    outs = eng.generate(sessions, 70, [NOEOS] * len(prompts))
    for i, (out, s) in enumerate(zip(outs, sessions)):
        assert list(out) == solo[2 * i]
        got = slot_bytes(eng, s)
        assert all(torch.equal(got[k], solo[2 * i + 1][k]) for k in got)


def test_the_mixed_forward_is_refused_where_a_row_would_change_its_bits(make_engine, device):
    """A model that runs decode rows alone (the CPU) or padded to a fixed count cannot share a forward with
    pieces: it says so rather than computing other bits."""
    eng = make_engine(mixed_rederive_pieces=(1, 2, 4))
    if device == "cuda":
        eng.runner.model.decode_rows = 64  # as where the start-up check finds a row-variant GEMM
    assert not (eng.runner.mixed_steps and device == "cpu")
    s, t = eng.open(toks(GRID, 1)), eng.open(toks(10, 2))
    with pytest.raises(ValueError, match="row count"):
        eng.runner.model.step_with_pieces(eng.state, eng.runner.slot_ids([t.slot]), torch.tensor([5], device=eng.runner.device),
                                          eng.runner.slot_ids([s.slot]), torch.tensor([toks(GRID, 3)],
                                                                                       device=eng.runner.device), 512)


def test_mixed_rederive_pieces_are_numbers_of_sessions_in_a_step():
    from pydantic import ValidationError

    from capsulert.config.engine import EngineConfig

    assert EngineConfig().mixed_rederive_pieces == (1, 2, 4)  # the CPU runs the two forwards whatever it says
    assert EngineConfig(mixed_rederive_pieces=(4, 1, 2, 2)).mixed_rederive_pieces == (1, 2, 4)
    assert EngineConfig(mixed_rederive_pieces=()).mixed_rederive_pieces == ()
    for bad in ((0,), (65,)):
        with pytest.raises(ValidationError, match="mixed_rederive_pieces"):
            EngineConfig(mixed_rederive_pieces=bad)
