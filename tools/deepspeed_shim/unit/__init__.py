"""Stand-in for DeepSpeed's ``tests/unit`` package (its ``common`` helpers)."""
