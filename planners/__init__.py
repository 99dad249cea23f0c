"""Pure decision logic: dataclasses in, decisions out; no Ray, torch or I/O (docs/architecture.md)."""
