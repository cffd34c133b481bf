"""Flow control: fair, priority- and deadline-aware admission under overload (docs/flow-control.md)."""
