"""The check stage: structural checks (dcpc.check.structural), then happens-before."""

from dcpc.check.structural import check

__all__ = ["check"]
