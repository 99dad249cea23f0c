"""The durable record of learning: the SQLite feedback store (``sqlite``), its records (``models``), and the one actor that owns it (``actor``)."""
