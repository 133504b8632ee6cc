"""Errors the engine reports: a stable code and a sentence a user can act on."""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """Base of every error the engine answers with.

    ``code`` is stable and machine-readable; ``message`` is for people;
    ``details`` names the field, sandbox, step or path involved.
    """

    code = "engine_error"
    status = 500  # the HTTP status the control plane maps it to

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidRequest(EngineError):
    code = "invalid_request"
    status = 400


class InvalidSize(InvalidRequest):
    code = "invalid_size"


class TtlOverMaximum(InvalidRequest):
    code = "ttl_over_maximum"


class InvalidPath(InvalidRequest):
    code = "invalid_path"


class UserNotFound(InvalidRequest):
    """An exec's ``user`` (or a template's default user) is not in the sandbox's own /etc/passwd."""

    code = "user_not_found"


class NotFound(EngineError):
    code = "not_found"
    status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class TemplateNotFound(NotFound):
    code = "template_not_found"


class FileNotFound(NotFound):
    code = "file_not_found"


class ProcessNotFound(NotFound):
    code = "process_not_found"


class Conflict(EngineError):
    code = "conflict"
    status = 409


class SandboxNotRunning(Conflict):
    code = "sandbox_not_running"


class DesktopNotRunning(Conflict):
    """A desktop call to a sandbox whose X desktop is not running (desktop.py)."""

    code = "desktop_not_running"


class TemplateExists(Conflict):
    code = "template_exists"


class FileExists(Conflict):
    code = "file_exists"


class NotAFile(Conflict):
    code = "not_a_file"


class NotADirectory(Conflict):
    code = "not_a_directory"


class ProcessNotRunning(Conflict):
    code = "process_not_running"


class InputNotRead(Conflict):
    """A background process read none of its input for a while (processes.py)."""

    code = "input_not_read"


class TooLarge(EngineError):
    code = "too_large"
    status = 413


class TooManyProcesses(EngineError):
    """A sandbox runs as many background processes as it may (processes.py)."""

    code = "too_many_processes"
    status = 429


class NoCapacity(EngineError):
    code = "no_capacity"
    status = 503


class CreateFailed(EngineError):
    """The kernel refused a step of creating a sandbox."""

    code = "create_failed"
    status = 500


class TemplateImportFailed(EngineError):
    code = "template_import_failed"
    status = 422


class InvalidImage(EngineError):
    """An uploaded archive that is no image (nor a root filesystem's tarball): the caller's to fix."""

    code = "invalid_image"
    status = 400


class ServiceNotReady(EngineError):
    """A snapshot's service did not answer its readiness check in time."""

    code = "service_not_ready"
    status = 504


class PortNotListening(EngineError):
    """Nothing in the sandbox listens on the port asked for (ports.py)."""

    code = "port_not_listening"
    status = 502


class Unavailable(EngineError):
    code = "engine_unavailable"
    status = 503


ERRORS_BY_CODE: dict[str, type[EngineError]] = {}


def _register(cls: type[EngineError]) -> None:
    ERRORS_BY_CODE[cls.code] = cls
    for subclass in cls.__subclasses__():
        _register(subclass)


_register(EngineError)


def from_dict(payload: dict[str, Any]) -> EngineError:
    """Rebuild an error received over the wire as its own class."""
    cls = ERRORS_BY_CODE.get(str(payload.get("code")), EngineError)
    error = cls(str(payload.get("message", "engine error")), **dict(payload.get("details") or {}))
    if cls is EngineError:
        error.code = str(payload.get("code", EngineError.code))
    return error
