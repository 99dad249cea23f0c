"""Full-model training: the full unit's loop (``loop``) on pipeline stage actors (``stage``, ``trainer``,
``scheduled``) and their messages."""
