"""Backends of leanopt's update rules. ``reference`` is plain tensor maths and the oracle."""
