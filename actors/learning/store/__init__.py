"""The durable record of learning: the SQLite feedback store (``sqlite``, its parts in ``schema``, ``connection``,
``adapter_registry``, ``feedback_rows`` and ``version_registry``), its records (``models``), and the one actor that
owns it (``actor``)."""
