"""A FastAPI route whose plain-JSON, valid request bodies skip FastAPI's request machinery.

FastAPI's own path for `async def route(body: Model, ns = Depends(tenant))` decodes the body with json.loads,
validates the dict, then solves the route's parameters and dependencies in Python: ~45 us a request on
the 2-core CPU box, about as much as the rest of the app's work on a request. Here a body sent as
`Content-Type: application/json` goes through pydantic's JSON parser straight into the model (one pass,
~5 us) and the endpoint is called with what `params(request)` gives for its other parameters.

Anything else takes FastAPI's path unchanged, on the same request (its body is cached): another content
type, a body that does not parse or does not validate. So every refusal is FastAPI's own, with the same
status, message and `param`; and a body the fast path refuses that FastAPI accepts (a byte-order mark, a
lone surrogate escape, which pydantic's parser refuses and json.loads accepts) is still served. A body both
accept gives the same model: pydantic's parser reads numbers and strings as json.loads does
(tests/serve/test_fast_paths.py checks the cases where they could differ).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

JSON = "application/json"


async def fast_body(request: Request, model: type[BaseModel]) -> BaseModel | None:
    """The request's body as `model` when it is plain JSON and valid; None: leave it to FastAPI."""
    if request.headers.get("content-type") != JSON:
        return None
    try:
        return model.model_validate_json(await request.body())
    except ValidationError:
        return None


def fast_route(model: type[BaseModel], body_param: str,
               params: Callable[[Request], dict[str, Any]]) -> type[APIRoute]:
    """An APIRoute class (FastAPI's documented extension point, `get_route_handler`) for an endpoint taking
    its body as `body_param: model`; `params(request)` gives its other arguments as its dependencies would
    (raising as they would, e.g. 401)."""

    class FastRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            strict = super().get_route_handler()
            endpoint = self.endpoint

            async def handler(request: Request) -> Response:
                body = await fast_body(request, model)
                if body is None:
                    return await strict(request)
                return await endpoint(**{body_param: body}, **params(request))
            return handler

    return FastRoute
