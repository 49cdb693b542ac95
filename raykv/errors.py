"""raykv's exceptions."""


class RaykvError(RuntimeError):
    """An operational problem (no Ray cluster, raykv not started...)."""


class BlockError(RuntimeError):
    """A block could not be stored or loaded (corrupt, missing, I/O error)."""
