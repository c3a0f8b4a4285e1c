"""best_of_n, tree_search and EpisodeDriver produce the same tokens as sequential runs of the same verbs
on the in-process engine; episode resets leak no slots and no capsules."""
import pytest
import pytest_asyncio

from capsulert.orchestrator import EpisodeDriver, Thought, best_of_n, tree_search
from capsulert.protocol.sampling import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")
PROMPT = "An agent plans its next move from the state of the repository and the failing test. "


@pytest_asyncio.fixture(loop_scope="session")
async def c0(orch, fresh):
    s = await orch.open(PROMPT)
    await s.snapshot("sched-c0")
    await s.close()
    e = fresh.open()
    e.append(PROMPT)
    e.snapshot("sched-c0")
    e.close()
    yield "sched-c0"
    await orch.delete("sched-c0")


async def _counts(orch):
    st = (await orch.stats())[0]
    return st["free_slots"], st["sessions"], st["capsules"]


async def test_best_of_n_equals_sequential(orch, fresh, c0):
    async def score(c):  # async scorer: prefer candidates with more distinct tokens, then a token checksum
        return len(set(c.tokens)) + (sum(c.tokens) % 101) / 1000

    base = SamplingParams(temperature=0.9, top_p=0.95, seed=100)
    cands = await best_of_n(orch, c0, " Plan:", 5, 6, base, score)
    assert sorted(c.index for c in cands) == list(range(5))
    assert [c.score for c in cands] == sorted((c.score for c in cands), reverse=True)
    for c in cands:
        r = fresh.restore(c0)
        r.append(" Plan:")
        assert c.tokens == r.generate(6, SamplingParams(temperature=0.9, top_p=0.95, seed=100 + c.index))
        assert c.text == fresh.detokenize(c.tokens)
        r.close()


@pytest.mark.parametrize("node_mode", ["full", "replay"])
async def test_tree_search_equals_sequential(orch, fresh, c0, node_mode):
    options = [" First,", " Instead,", " So"]

    def expand(node):
        return [Thought(o) for o in options]

    def score(node):
        return (sum(node.tokens) * 31 + node.depth) % 1009

    before = await _counts(orch)
    beam = await tree_search(orch, c0, expand, score, width=2, depth=3, max_new_tokens=3, node_mode=node_mode)
    assert await _counts(orch) == before  # every node capsule deleted, every slot back

    # the same beam search, sequentially, with in-process verbs (a node = (name, thoughts, score))
    frontier, k = [(c0, [], 0)], 0
    for depth in range(1, 4):
        children = []
        for name, thoughts, _ in frontier:
            for o in options:
                r = fresh.restore(name)
                r.append(o)
                toks = r.generate(3)
                k += 1
                r.snapshot(f"seq-{k}")
                r.close()
                children.append((f"seq-{k}", thoughts + [toks], (sum(toks) * 31 + depth) % 1009))
        order = sorted(range(len(children)), key=lambda i: (-children[i][2], i))
        frontier = [children[i] for i in order[:2]]
    assert [n.thoughts for n in beam] == [f[1] for f in frontier]
    assert [n.score for n in beam] == [f[2] for f in frontier]


async def test_episode_driver_equals_sequential(orch, fresh, c0):
    def policy(ep, step, action):
        return None if step == 3 else f" obs {ep}.{step}:{len(action or [])}"

    def sampling(ep, step):
        return SamplingParams(temperature=0.8, seed=1000 * ep + step)

    async with EpisodeDriver(orch, c0, n_envs=3, max_new_tokens=3, sampling=sampling) as drv:
        trajs = await drv.run(policy, episodes=5)
    s = fresh.open()
    for t in trajs:
        s.restore(c0)
        assert len(t.steps) == 3
        for step, (obs, action) in enumerate(t.steps):
            assert obs == policy(t.episode, step, t.steps[step - 1][1] if step else None)
            s.append(obs)
            assert action == s.generate(3, sampling(t.episode, step)), (t.episode, step)
    s.close()


async def test_thousand_resets_leak_nothing(orch, c0):
    before = await _counts(orch)
    drv = await EpisodeDriver(orch, c0, n_envs=4, max_new_tokens=1).start()
    for i in range(8):
        await drv.reset(i % 4)
    await drv.run(lambda ep, step, action: None, episodes=992)  # reset-only episodes
    assert drv.resets == 1000
    free, sessions, capsules = await _counts(orch)
    assert (free, sessions, capsules) == (before[0] - 4, before[1] + 4, before[2])
    assert await drv.step(0, " go") and await drv.step(3, [5, 6])
    await drv.close()
    assert await _counts(orch) == before


async def test_episode_driver_step_passes_the_real_episode_and_step(orch, c0):
    """step() gives the sampling callable env i's (episode, step): episodes sampled at temperature 1 differ,
    and every action carries its logprobs and stop reason."""
    seen = []

    def sampling(ep, step):
        seen.append((ep, step))
        return SamplingParams(temperature=1.0, seed=1000 * ep + step, ignore_eos=True)

    async with EpisodeDriver(orch, c0, n_envs=1, max_new_tokens=6, sampling=sampling) as drv:
        actions = []
        for _ in range(3):
            await drv.reset(0)
            first = await drv.step(0, " look around")
            await drv.step(0, " and again")
            actions.append(list(first))
            assert len(first.logprobs) == 6 and first.stop_reason == "length"
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert len({tuple(a) for a in actions}) == 3  # three episodes, three different samples
