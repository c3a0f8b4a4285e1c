"""`capsulert serve` through the official openai client: every answer is checked against the in-process
engine (token ids, text and logprobs bitwise), plus capsules, tenants, errors, back-pressure and metrics."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from capsulert.chat.template import ChatTemplate
from capsulert.protocol.sampling import SamplingParams

MODEL = "capsulert-default"  # what the server fixture serves (--served-model-name)
PROMPT = "The capsule runtime keeps the complete state of a session at a committed boundary, so an agent can"
TOKEN_IDS = {"return_token_ids": True}


def reference(oracle, prompt, max_tokens, *, prefix=(), **sampling):
    """What the in-process engine generates for prompt (after `prefix` turns: (text, n) pairs)."""
    s = oracle.open()
    try:
        for text, n in prefix:
            s.append(text)
            s.generate(n, SamplingParams(**sampling))
        s.append(prompt)
        return s.generate(max_tokens, SamplingParams(**sampling))
    finally:
        s.close()


def chat_prompt(server, oracle, messages):
    eos = oracle.tokenizer.id_to_token(0)
    text = ChatTemplate.for_model(server.model_dir, eos).render(messages)
    return oracle.tokenizer.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------- models
def test_models_lists_the_served_model(acme, server):
    assert [m.id for m in acme.models.list().data] == [MODEL]
    # the replica's own HTTP server answers: Serve's proxy (--serve-proxy) would stamp an x-request-id
    assert "x-request-id" not in server.http("GET", "/v1/models").headers


# ------------------------------------------------------------------------------------------ completions
def test_completion_matches_the_engine_bitwise(acme, oracle):
    want = reference(oracle, PROMPT, 24)
    r = acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                extra_body=TOKEN_IDS)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == list(want)
    assert c.text == want.text
    assert c.logprobs.token_logprobs == want.logprobs  # floats through JSON: exact
    assert c.finish_reason == {"length": "length", "eos": "stop"}[want.stop_reason]
    n_prompt = len(oracle.tokenize(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(want))
    assert r.usage.total_tokens == n_prompt + len(want)


def test_token_id_prompts_and_batches(acme, oracle):
    texts = [PROMPT, " Restoring a capsule"]
    want = [list(reference(oracle, t, 8)) for t in texts]
    for prompt in (texts, [oracle.tokenize(t) for t in texts]):  # a batch of texts, a batch of token-id lists
        r = acme.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=TOKEN_IDS)
        assert [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)] == want
    r = acme.completions.create(model=MODEL, prompt=oracle.tokenize(texts[1]), max_tokens=8, temperature=0,
                                extra_body=TOKEN_IDS)
    assert r.choices[0].model_extra["token_ids"] == want[1]


def test_streamed_completion_is_the_same_as_whole(acme, oracle):
    want = reference(oracle, PROMPT, 20)
    chunks = list(acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                          stream_options={"include_usage": True}, extra_body=TOKEN_IDS))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == want.text
    assert [t for c in choices for t in c.model_extra["token_ids"]] == list(want)
    assert [c.finish_reason for c in choices][-1] == "length" and all(c.finish_reason is None for c in choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_stop_strings_cut_the_text(acme, oracle):
    full = reference(oracle, PROMPT, 24).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = reference(oracle, PROMPT, 24, stop=(stop, "never-in-the-text"))
    assert want.stop_reason == "stop_string" and len(want.text) < len(full)
    r = acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                stop=[stop, "never-in-the-text"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
    streamed = acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text  # nothing of the stop shown


def test_top_logprobs_match_the_engine(acme, oracle):
    want = reference(oracle, PROMPT, 6, logprobs=3)
    r = acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    piece = lambda t: oracle.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    assert lp.tokens == [piece(t) for t in want]
    assert lp.top_logprobs == [{piece(t): v for t, v in row} for row in want.top_logprobs]
    # streamed: each chunk carries the top-k of its own tokens, as they are produced (not all at the end)
    chunks = [c.choices[0] for c in acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                                             logprobs=3, stream=True) if c.choices]
    with_tokens = [c.logprobs for c in chunks if c.logprobs is not None]
    assert len(with_tokens) > 1 and all(len(x.top_logprobs) == len(x.tokens) for x in with_tokens)
    assert [row for x in with_tokens for row in x.top_logprobs] == lp.top_logprobs
    assert [v for x in with_tokens for v in x.token_logprobs] == lp.token_logprobs


def test_n_branches_fork_and_match_seeded_runs(acme, oracle):
    r = acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7, n=3,
                                extra_body=TOKEN_IDS)
    got = {c.index: c.model_extra["token_ids"] for c in r.choices}
    want = {j: list(reference(oracle, PROMPT, 12, temperature=0.9, seed=7 + j)) for j in range(3)}
    assert got == want
    assert len({tuple(v) for v in got.values()}) > 1  # the seeds differ, so do the branches
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == len(oracle.tokenize(PROMPT))
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for chunk in acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7, n=3,
                                         stream=True, extra_body=TOKEN_IDS):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra["token_ids"]
    assert streamed == want


def test_speculate_extra_field_gives_the_same_completion(acme, oracle):
    """speculate / speculate_drafter (extra body fields) reach the engine's SamplingParams: the same tokens
    and logprobs as without them, greedy and seeded, n and stream included."""
    prompt = PROMPT + " the capsule keeps the state, the capsule keeps the KV, the capsule keeps"
    want = reference(oracle, prompt, 20, temperature=0)
    r = acme.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=0,
                                extra_body={**TOKEN_IDS, "speculate": 3, "speculate_drafter": "ngram"})
    assert r.choices[0].model_extra["token_ids"] == list(want)
    assert r.choices[0].logprobs.token_logprobs == want.logprobs
    seeded = {j: list(reference(oracle, prompt, 12, temperature=0.9, seed=3 + j)) for j in range(2)}
    r = acme.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, seed=3, n=2,
                                extra_body={**TOKEN_IDS, "speculate": 2})
    assert {c.index: c.model_extra["token_ids"] for c in r.choices} == seeded
    streamed: list[int] = []
    for chunk in acme.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                         extra_body={**TOKEN_IDS, "speculate": 1}):
        streamed += chunk.choices[0].model_extra["token_ids"] if chunk.choices else []
    assert streamed == list(want)


# ------------------------------------------------------------------------------------------------ chat
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a capsule?"}]


def test_chat_renders_the_template_and_matches_the_engine(server, acme, oracle):
    ids = chat_prompt(server, oracle, MESSAGES)
    want = reference(oracle, ids, 16, logprobs=2)
    r = acme.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                                     top_logprobs=2, extra_body=TOKEN_IDS)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == list(want) and c.message.content == want.text
    assert c.message.role == "assistant" and r.usage.prompt_tokens == len(ids)
    assert [e.logprob for e in c.logprobs.content] == want.logprobs
    assert [[a.logprob for a in e.top_logprobs] for e in c.logprobs.content] == [[v for _, v in row] for row in want.top_logprobs]
    stream = acme.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == want.text


# -------------------------------------------------------------------------------------- prefix cache
def test_a_second_chat_turn_resending_its_history_hits_the_prefix_cache(server, acme, globex, oracle):
    """The server reuses the longest cached grid prefix of every prompt (on by default): the second turn of
    a conversation skips the prefill of the first turn's grid prefix, and answers exactly as the in-process
    engine does after a cold prefill; another tenant's identical conversation is not served from it."""
    system = {"role": "system", "content": " ".join(["You answer briefly, and only about capsules."] * 12)}
    turn1 = [system, {"role": "user", "content": "What is a capsule?"}]
    r1 = acme.chat.completions.create(model=MODEL, messages=turn1, max_tokens=12, temperature=0, extra_body=TOKEN_IDS)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And how is it restored?"}]
    ids = chat_prompt(server, oracle, turn2)
    assert len(ids) > 2 * 128  # past several grid points (one every 64 tokens)
    want = reference(oracle, ids, 12)
    r2 = acme.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, temperature=0, extra_body=TOKEN_IDS)
    assert r2.choices[0].model_extra["token_ids"] == list(want)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 128 and cached % 64 == 0 and r2.usage.prompt_tokens == len(ids)
    g = globex.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, temperature=0, extra_body=TOKEN_IDS)
    assert g.usage.prompt_tokens_details.cached_tokens == 0  # namespaces isolate the cache
    assert g.choices[0].model_extra["token_ids"] == list(want)
    streamed = acme.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


# -------------------------------------------------------------------------------------------- capsules
def test_capsule_round_trip_within_a_tenant(server, acme, oracle):
    first = acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"snapshot_as": "ctx-a"})
    made = first.model_extra["capsule"]
    assert made["name"] == "ctx-a" and made["tokens"] == first.usage.prompt_tokens + 5
    rows = server.http("GET", "/v1/capsules").json()["data"]
    assert [c["id"] for c in rows] == ["ctx-a"]
    # one meaning per field name: size_bytes is the whole state in both replies; own_bytes what it holds alone
    assert rows[0]["size_bytes"] == made["size_bytes"] > 0 and 0 < rows[0]["own_bytes"] <= made["size_bytes"]
    assert "nbytes" not in made and "nbytes" not in rows[0]

    turn = " A user question"
    want = reference(oracle, turn, 10, prefix=[(PROMPT, 5)])
    r = acme.completions.create(model=MODEL, prompt=turn, max_tokens=10, temperature=0,
                                extra_body={"capsule": "ctx-a", **TOKEN_IDS})
    assert r.choices[0].model_extra["token_ids"] == list(want)
    assert r.usage.prompt_tokens_details.cached_tokens == made["tokens"]
    again = acme.completions.create(model=MODEL, prompt=turn, max_tokens=10, temperature=0, stream=True,
                                    extra_body={"capsule": "ctx-a"})
    assert "".join(c.choices[0].text for c in again if c.choices) == want.text

    with pytest.raises(openai.ConflictError):  # capsules are immutable
        acme.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"snapshot_as": "ctx-a"})
    assert server.http("DELETE", "/v1/capsules/ctx-a").json() == {"id": "ctx-a", "object": "capsule", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        acme.completions.create(model=MODEL, prompt=turn, max_tokens=1, extra_body={"capsule": "ctx-a"})


def test_a_tenant_cannot_see_or_touch_another_tenants_capsules(server, acme, globex):
    acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"snapshot_as": "secret"})
    assert server.http("GET", "/v1/capsules", tenant="globex").json()["data"] == []
    for call in (lambda: globex.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"capsule": "secret"}),
                 lambda: globex.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, stream=True,
                                                        extra_body={"capsule": "secret"})):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "capsule_not_found"
    assert server.http("DELETE", "/v1/capsules/secret", tenant="globex").status_code == 404
    # the same name in globex is globex's own capsule, unrelated to acme's
    globex.completions.create(model=MODEL, prompt="Other text", max_tokens=1, extra_body={"snapshot_as": "secret"})
    rows = {t: server.http("GET", "/v1/capsules", tenant=t).json()["data"] for t in ("acme", "globex")}
    assert rows["acme"][0]["tokens"] != rows["globex"][0]["tokens"]
    for t in ("acme", "globex"):
        assert server.http("DELETE", "/v1/capsules/secret", tenant=t).status_code == 200


# ---------------------------------------------------------------------------------------------- errors
def test_keys_are_required_and_checked(server):
    for tenant, headers in ((None, {}), (None, {"Authorization": "Bearer sk-not-a-key-000"}),
                            (None, {"Authorization": server.keys["acme"]})):
        r = server.http("GET", "/v1/capsules", tenant=tenant, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-not-a-key-000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_an_unknown_field_is_accepted_not_400(server):
    """Issue 28: fields capsulert does not know are ignored (one warning per name), as vLLM does."""
    r = server.http("POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "surprise": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "n": 2, "snapshot_as": "two"}, None),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "", "max_tokens": 1}, None),
    ({"prompt": "x", "snapshot_as": "a/b"}, None),
    ({"prompt": "x " * 600, "max_tokens": 1}, None),  # past max_seq
    ({"prompt": "x " * 600, "max_tokens": 1, "stream": True}, None),  # refused by the streaming turn itself
    ({"prompt": "x", "top_k": 2 ** 70}, None),
    ({"prompt": "x", "speculate": 4}, "speculate"),
    ({"prompt": "x", "speculate": 2, "speculate_drafter": "nosuch"}, None),  # refused where the drafters are
    ({"prompt": "x", "speculate": 2, "structured_outputs": {"regex": "[ab]+"}}, None),
])
def test_bad_requests_are_400_openai_json(server, body, param):
    r = server.http("POST", "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert "Traceback" not in r.text and (param is None or err["param"] == param)


def test_a_stop_string_with_a_lone_surrogate_is_400(server):
    """JSON can carry one (an escaped \ud800); decoded text never holds one, so it could never match."""
    body = json.dumps({"model": MODEL, "prompt": "x", "stop": ["a\ud800"]})  # ASCII, the surrogate escaped
    r = server.http("POST", "/v1/completions", content=body, headers={
        "Authorization": f"Bearer {server.keys['acme']}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text


def test_unknown_model_and_route_are_404(server, acme):
    with pytest.raises(openai.NotFoundError) as e:
        acme.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    r = server.http("GET", "/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_past_max_inflight_is_429(server, acme):
    """max_inflight streams held open fill the server: one more request is refused, then all is well again."""
    held = [acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True}) for _ in range(server.max_inflight)]
    try:
        for s in held:
            next(iter(s))  # each is generating now
        with pytest.raises(openai.RateLimitError) as e:
            acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert int(e.value.response.headers["retry-after"]) >= 1  # when to come back
    finally:
        for s in held:
            s.close()  # the client goes away: the server interrupts the generates and frees their slots
    deadline = time.monotonic() + 30
    while True:
        try:
            assert acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the server never recovered from the closed streams"
            time.sleep(0.2)


def test_concurrent_requests_are_each_exact(server, acme, oracle):
    prompts = [f"{PROMPT} Agent {i} says" for i in range(server.max_inflight)]
    want = [list(reference(oracle, p, 10)) for p in prompts]
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        r = acme.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0, extra_body=TOKEN_IDS)
        got[i] = r.choices[0].model_extra["token_ids"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(len(prompts))] == want


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """GET /metrics (no key needed) as {(series name, its labels): value}."""
    r = server.http("GET", "/metrics", tenant=None)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("capsulert_"), family.name
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = sample.value
    return out


def count(samples, name: str, **labels) -> float:
    """The sum of the series `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_metrics_have_our_names_and_labels_only(server, acme):
    acme.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    samples = scrape(server)
    assert {n for n, _ in samples} >= {"capsulert_requests_total", "capsulert_generated_tokens_total",
                                       "capsulert_request_seconds_count", "capsulert_inflight_requests"}
    assert {k for _, ls in samples for k, _ in ls} <= {"model", "namespace", "route", "status", "tier", "le"}
    assert count(samples, "capsulert_generated_tokens_total", model=MODEL, namespace="acme", route="completions") >= 2


def test_every_refused_request_is_counted(server):
    """Refusals anywhere count: FastAPI's validation, the key check, an unknown route, the app's own."""
    refusals = [("POST", "/v1/completions", "acme", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
                ("POST", "/v1/chat/completions", "acme", {"model": MODEL, "messages": "not a list"}, 400),
                ("POST", "/v1/completions", "acme", {"model": "gpt-4", "prompt": "x"}, 404),
                ("POST", "/v1/completions", None, {"model": MODEL, "prompt": "x"}, 401),
                ("GET", "/v1/nothing", "acme", None, 404)]
    before = scrape(server)
    for method, path, tenant, body, status in refusals * 2:
        assert server.http(method, path, tenant=tenant, json=body).status_code == status
    after = scrape(server)

    def delta(**labels):
        return count(after, "capsulert_requests_total", **labels) - count(before, "capsulert_requests_total", **labels)
    assert delta(status="400") == 4 and delta(status="404") == 4 and delta(status="401") == 2
    assert delta(route="completions", namespace="acme", status="400") == 2  # the body was read after the key
    assert delta(route="chat", status="400") == 2 and delta(route="other", status="404") == 2
    assert delta(namespace="", status="401") == 2  # no namespace: the key was refused


def test_only_the_server_serves_metrics(server):
    """Ray's metrics agent exports nothing unless asked (--ray-metrics-port): of every port the server's
    processes listen on, only the server's own answers GET /metrics with Prometheus metrics, but for the two
    small exporters Ray's autoscaler and dashboard processes start on their own whenever prometheus_client is
    installed (no Ray setting turns them off; a Ray already holding their ports on the machine keeps them)."""
    procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    pids = {p.pid for p in procs}
    # each socket is asked on the address it listens on: the same port number on another address can belong
    # to another process (a Ray of another test run on this machine)
    owner = {(c.laddr.ip, c.laddr.port): c.pid for c in psutil.net_connections("tcp")
             if c.pid in pids and c.status == psutil.CONN_LISTEN}
    own = int(server.url.rsplit(":", 1)[1])
    assert own in {port for _, port in owner} and len(owner) > 1
    exporters = []
    for (ip, port), pid in owner.items():
        if port == own:
            continue
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(ip, f"[{ip}]" if ":" in ip else ip)
        try:
            r = httpx.get(f"http://{host}:{port}/metrics", timeout=2)
        except httpx.HTTPError:
            continue  # not HTTP (Ray's gRPC servers)
        if r.status_code == 200 and "# TYPE" in r.text:
            exporters.append((port, " ".join(psutil.Process(pid).cmdline())))
    ray_own = [(port, cmd) for port, cmd in exporters
               if "autoscaler/_private/monitor.py" in cmd or "dashboard/dashboard.py" in cmd]
    assert all(port in (44217, 44227) for port, _ in ray_own), ray_own  # Ray's fixed ports for those two
    assert [e for e in exporters if e not in ray_own] == []


def test_metrics_count_capsule_hits_by_tier(server):
    deadline = time.monotonic() + 20
    while True:
        names = {n for n, _ in scrape(server)}
        want = {"capsulert_ttft_seconds_count", "capsulert_capsule_lookups_total", "capsulert_capsule_hits_total",
                "capsulert_restore_seconds_count"}
        if want <= names or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert want <= names, sorted(names)
    samples = scrape(server)
    # the capsule round trip read from device memory
    assert count(samples, "capsulert_capsule_hits_total", tier="device", namespace="acme") > 0
