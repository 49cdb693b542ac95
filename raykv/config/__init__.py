"""Typed, validated options (``options``), config files (``file``), the lazy tier registry (``factory``)."""
