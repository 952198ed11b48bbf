"""The controller's exception tree: each maps to one HTTP status and error code.

They are tornado ``HTTPError``s so a handler can raise them anywhere; the API's
``write_error`` turns them into ``{code, message, details}``.
"""

from tornado import web


class ControllerError(web.HTTPError):
    """Base class for errors the controller turns into JSON responses."""

    status = 500
    code = "internal"

    def __init__(self, message: str, details: object = None):
        super().__init__(self.status)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


class BadRequest(ControllerError):
    """The request body or parameters are malformed or ask for something impossible."""

    status = 400
    code = "bad-request"


class Unauthenticated(ControllerError):
    """No valid JupyterHub token or login cookie came with the request."""

    status = 401
    code = "unauthenticated"


class Forbidden(ControllerError):
    """The caller is known but lacks the scope, or the workload is not theirs."""

    status = 403
    code = "forbidden"


class NotFoundError(ControllerError):
    """The named object does not exist (or the caller may not know that it does)."""

    status = 404
    code = "not-found"


class UnsupportedMediaType(ControllerError):
    """A write to the API sent a body that is not JSON (its Content-Type says another)."""

    status = 415
    code = "unsupported-media-type"


class Conflict(ControllerError):
    """The object is in a state where this operation does not apply."""

    status = 409
    code = "conflict"


class NotLeader(ControllerError):
    """This controller does not hold the database lease; another one is active."""

    status = 503
    code = "not-leader"


class HubUnavailable(ControllerError):
    """The hub could not check the caller's token (it did not answer, or failed): nothing
    was done, and the same request may succeed once it answers."""

    status = 503
    code = "hub-unavailable"


class ClusterUnavailable(ControllerError):
    """A Kubernetes cluster's API server did not answer or refused what the controller
    asked of it; nothing was changed. The message names the cluster and what failed."""

    status = 503
    code = "cluster-unavailable"
