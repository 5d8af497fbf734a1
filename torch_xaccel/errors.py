"""Exception and warning types the user can catch or filter."""


class XaccelConfigError(ValueError):
    """An XACCEL_* environment variable, or torch.compile's mode= / options=, holds a value the
    backend does not accept."""


class XaccelFallbackWarning(UserWarning):
    """The backend could not do its work and ran the captured graph (or an op) without it."""
