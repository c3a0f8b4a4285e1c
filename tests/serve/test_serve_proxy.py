"""`capsulert serve --serve-proxy`: the same server behind Ray Serve's HTTP proxy instead of the replica's own
HTTP server (the default, tested in test_server.py) answers the same, streamed or whole."""
from __future__ import annotations

from conftest import MODEL, running_server
from test_server import PROMPT, TOKEN_IDS, reference


def test_behind_serve_proxy_the_answers_are_the_same(default_model_dir, tmp_path, oracle):
    want = reference(oracle, PROMPT, 12)
    with running_server(default_model_dir, tmp_path, "--serve-proxy") as proxied:
        r = proxied.http("GET", "/v1/models")
        assert r.status_code == 200 and "x-request-id" in r.headers  # Serve's proxy stamps every response
        cl = proxied.client("acme")
        whole = cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=TOKEN_IDS)
        assert whole.choices[0].model_extra["token_ids"] == list(want) and whole.choices[0].text == want.text
        chunks = list(cl.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            extra_body=TOKEN_IDS))
        assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == list(want)
        missing = proxied.http("DELETE", "/v1/capsules/nothing-here")  # an unknown capsule
        assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
