"""raykv's exceptions."""


class RaykvError(RuntimeError):
    """An operational problem (no Ray cluster, raykv not started...)."""


class BlockError(RuntimeError):
    """A block could not be stored or loaded (corrupt, missing, I/O error)."""


def root_cause(exc: BaseException) -> str:
    """One line saying what went wrong at the bottom of ``exc``.

    Ray wraps an actor's failure (``ActorDiedError`` around a ``RayTaskError``
    around the real exception) in messages that carry whole tracebacks; this
    digs out the original exception, else the last ``...Error: ...`` line.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not type(e).__module__.startswith("ray."):
            text = str(e).strip().splitlines()
            return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
        cause = getattr(e, "cause", None)
        e = cause if isinstance(cause, BaseException) else None
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return lines[0] if lines else type(exc).__name__
