"""Adapter versions as files: their layout and storage URIs (``layout``), transport between nodes (``files``), and
whether one fits the served base (``fit``)."""
