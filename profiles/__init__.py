"""Shipped YAML profiles (and trained drafters under drafters/)."""
