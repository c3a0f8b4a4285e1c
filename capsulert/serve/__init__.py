"""`capsulert serve`: an OpenAI-compatible HTTP server, a Ray Serve application in front of the Orchestrator.

    runner.py      the command: logging, Ray, Ray Serve, wait for Ctrl-C
    deployment.py  the Serve deployment: one replica owning the Orchestrator and the app
    app.py         the FastAPI routes, admission control, SSE responses, error handlers
    bodies.py      request bodies (pydantic)         plans.py      request -> Plan (tokenized, checked)
    generation.py  a Plan run on the orchestrator    responses.py  OpenAI response and chunk shapes
    token_text.py  the tokenizer in the server process (chat templates, tools, formats: capsulert/chat)
    tenants.py     API keys -> namespaces            metrics.py    Prometheus metrics (prometheus_client)
    streaming.py   stop-string holdback, SSE         http_errors.py  errors -> status codes and JSON
    responses_api.py  POST /v1/responses: its run and the stored responses (capsules) previous_response_id
                   continues             responses_bodies.py  its request bodies (pydantic)
    edge.py        body size and capsule quotas  grammar_budget.py  costly grammars built off the event loop
    (config/server.py: ServerOptions; ingress.py, lane.py: the replica's own HTTP server and its fast path)

Nothing here is imported by `import capsulert`; the server's dependencies are the `serve` extra.
"""
