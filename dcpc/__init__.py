"""dcpc: a declarative communication-schedule compiler for decode context parallelism."""

__version__ = "0.1.0"
