"""The API's base handler: identity from JupyterHub, scope checks, JSON errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError
from tornado import web

from ...scheduler import errors as store_errors
from ...scheduler.validation import name_problem, shown
from ..errors import (
    BadRequest,
    Conflict,
    ControllerError,
    Forbidden,
    NotFoundError,
    NotLeader,
    Unauthenticated,
    UnsupportedMediaType,
)
from .identity import Identity

if TYPE_CHECKING:
    from ..context import ControllerContext

ModelT = TypeVar("ModelT", bound=BaseModel)
MAX_ID = 2**62  # above every id a database row can have
MAX_ID_DIGITS = len(str(MAX_ID))  # 19: checked before int(), which refuses 4,301 digits
WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def media_type_problem(content_type: str | None) -> str | None:
    """Why a write's body with this Content-Type is not read, or None for JSON.

    A body without a Content-Type is read as JSON (a bare ``curl --data-binary`` or a
    script's POST), but one that declares another type is refused rather than guessed at:
    a form's ``application/x-www-form-urlencoded`` body is no JSON document. JSON is UTF-8
    (RFC 8259), so a charset, if named, must be that.
    """
    if content_type is None:
        return None
    media_type, *parameters = (part.strip().lower() for part in content_type.split(";"))
    if media_type != "application/json":
        return (
            f"send the body as JSON with 'Content-Type: application/json', not {shown(media_type)}"
        )
    for parameter in parameters:
        key, _, value = parameter.partition("=")
        if key.strip() == "charset" and value.strip().strip('"') not in ("utf-8", "utf8"):
            return f"send JSON as UTF-8 ('charset=utf-8'), not {shown(value.strip())}"
    return None


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
        if self.request.method in WRITES and self.request.body:
            problem = media_type_problem(self.request.headers.get("Content-Type"))
            if problem is not None:
                raise UnsupportedMediaType(problem)
        self._refuse_unfit_text()

    def _refuse_unfit_text(self) -> None:
        """A name in the path (a user, node or project) or a query parameter with NUL or a
        bidirectional control can name nothing; PostgreSQL would refuse the NUL anyway."""
        for segment in self.path_args:
            problem = name_problem(segment)
            if problem is not None:
                raise BadRequest(f"the path's {shown(segment)} {problem}; no name does")
        for name, values in self.request.query_arguments.items():
            for raw in values:
                text = raw.decode("utf-8", "replace")
                problem = name_problem(text)
                if problem is not None:
                    raise BadRequest(f"query parameter {shown(name)} {problem}")

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
        """A workload's or job's id from the URL. The route admits ``\\d+``, which also
        matches other scripts' digits and any length; an id no row can have (not ASCII
        digits, above 2^62, or too long for int() to read) is a 400, not an overflow in
        the database or Python's 4,300-digit limit. A possible id without a row is a 404."""
        if not (text.isascii() and text.isdigit() and len(text) <= MAX_ID_DIGITS):
            raise BadRequest(f"{shown(text)} is not a valid id: ids are whole numbers up to 2^62")
        value = int(text)
        if value > MAX_ID:
            raise BadRequest(f"{text} is not a valid id: ids are whole numbers up to 2^62")
        return value

    def int_argument(self, name: str, default: int, low: int, high: int) -> int:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        try:  # a ValueError too for 4,301 digits or more (Python's limit on int())
            value = int(raw)
        except ValueError as e:
            raise BadRequest(
                f"query parameter {name} must be a whole number, not {shown(raw)}"
            ) from e
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
