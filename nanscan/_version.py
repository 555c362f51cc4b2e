"""nanscan's version, in a module of its own: what writes it into files (the event log's header)
imports this instead of the package, whose ``__init__`` imports those writers (an import cycle)."""
__version__ = "0.1.0"
