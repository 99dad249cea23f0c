"""Pure decision logic: dataclasses in, decisions out; no Ray, torch or I/O (DESIGN §3)."""
