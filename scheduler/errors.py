"""The scheduler package's exception tree."""


class SchedulerError(Exception):
    """Base class for every error the scheduler package raises."""


class InvalidRequest(SchedulerError):
    """A request for GPUs that can never be satisfied as written (bad type, count, project).

    The message says what to change; nothing was recorded.
    """


class StoreError(SchedulerError):
    """Base class for problems with the controller's database."""


class SchemaMismatch(StoreError):
    """The database schema is not the one this version of gpufleet expects.

    The message names the command that fixes it.
    """


class LeaseLost(StoreError):
    """This controller no longer holds the database lease; another one took over.

    Raised inside a write transaction, which is then rolled back, so a fenced-off
    controller can never commit a decision.
    """


class CycleConflict(StoreError):
    """A row changed between the scheduler's read and its commit; the cycle was rolled
    back and the next one starts from a fresh read."""


class NotFound(StoreError):
    """The named row (workload, node, project) does not exist."""


class InputError(SchedulerError):
    """A trace, fleet or projects file (or declaration) that cannot be used as written.

    The message names the file, line or entry and what to fix.
    """
