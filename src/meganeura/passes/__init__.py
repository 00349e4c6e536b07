"""Graph rewrites run before scheduling."""
from .lower import lower_to_primitives  # noqa: F401
