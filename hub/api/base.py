"""The API's base handler: identity from JupyterHub, scope checks, JSON errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from tornado import web

from ...scheduler import errors as store_errors
from ..errors import (
    BadRequest,
    Conflict,
    ControllerError,
    Forbidden,
    NotFoundError,
    NotLeader,
    Unauthenticated,
)
from .identity import Identity

if TYPE_CHECKING:
    from ..context import ControllerContext

ModelT = TypeVar("ModelT", bound=BaseModel)
MAX_ID = 2**62  # above every id a database row can have


@contextmanager
def store_errors_as_http() -> Iterator[None]:
    """Map the store's exceptions to the API's at the I/O edge."""
    try:
        yield
    except store_errors.InvalidRequest as e:
        raise BadRequest(str(e)) from e
    except store_errors.NotFound as e:
        raise NotFoundError(str(e)) from e
    except store_errors.LeaseLost as e:
        raise NotLeader(str(e)) from e


class APIHandler(web.RequestHandler):
    controller: ControllerContext
    identity: Identity | None = None

    def initialize(self, controller: ControllerContext) -> None:
        self.controller = controller

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")

    def check_xsrf_cookie(self) -> None:
        # Writes require a token (see prepare), so cookie-borne XSRF cannot reach them.
        return

    async def prepare(self) -> None:
        self.identity = await self.controller.identify(self)
        if (
            self.identity is not None
            and self.identity.by_cookie
            and self.request.method not in ("GET", "HEAD", "OPTIONS")
        ):
            raise Forbidden("changes through the API need a token in the Authorization header")

    def require(self, *any_of: str) -> Identity:
        """The caller's identity, if it holds one of the scopes ``any_of`` (or admin)."""
        if self.identity is None:
            raise Unauthenticated(
                "send a JupyterHub API token as 'Authorization: token <token>', or log in"
            )
        if not any(self.identity.has(scope) for scope in any_of):
            raise Forbidden(f"this needs one of the scopes: {', '.join(any_of)}")
        return self.identity

    def body(self, model: type[ModelT]) -> ModelT:
        raw = self.request.body or b"{}"
        if b"\\u" in raw:  # only an escape can carry a lone surrogate, which no store takes
            try:
                json.dumps(json.loads(raw), ensure_ascii=False).encode()
            except UnicodeEncodeError as e:
                raise BadRequest(
                    "the request body holds text that is not valid Unicode (a lone "
                    "surrogate escape such as \\ud800); send UTF-8 text"
                ) from e
            except ValueError:
                pass  # not JSON: the model's validation says what is wrong
        try:
            return model.model_validate_json(raw)
        except ValidationError as e:
            details = [
                {"field": ".".join(str(p) for p in err["loc"]), "problem": err["msg"]}
                for err in e.errors(include_url=False, include_input=False)
            ]
            summary = "; ".join(f"{d['field'] or 'body'}: {d['problem']}" for d in details)
            raise BadRequest(f"the request body is not valid: {summary}", details) from e

    @staticmethod
    def path_id(text: str) -> int:
        """A workload's or job's id from the URL (the route admits digits only); one too
        large to be any row's is a 404, not an overflow in the database."""
        value = int(text)
        if value > MAX_ID:
            raise NotFoundError(f"there is no workload or job {text}")
        return value

    def int_argument(self, name: str, default: int, low: int, high: int) -> int:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError as e:
            raise BadRequest(f"query parameter {name} must be a whole number, not {raw!r}") from e
        if not low <= value <= high:
            raise BadRequest(f"query parameter {name} must be between {low} and {high}")
        return value

    def send(self, payload: BaseModel | dict[str, Any], status: int = 200) -> None:
        self.set_status(status)
        if isinstance(payload, BaseModel):
            self.finish(payload.model_dump_json())
        else:
            self.finish(json.dumps(payload, default=str))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ControllerError):
            body = {"code": exc.code, "message": exc.message, "details": exc.details}
        elif isinstance(exc, web.HTTPError):
            body = {"code": "http", "message": exc.log_message or self._reason, "details": None}
        else:
            body = {
                "code": "internal",
                "message": "internal error; see the controller log",
                "details": None,
            }
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(body))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, ControllerError) and value.status < 500:
            self.controller.log.info(
                "%s %s -> %d %s",
                self.request.method,
                self.request.path,
                value.status,
                value.message,
            )
            return
        super().log_exception(typ, value, tb)


__all__ = ["APIHandler", "Conflict", "Identity", "store_errors_as_http"]
